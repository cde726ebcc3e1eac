"""Page store on a local directory: each batch of pages one pack file, written atomically, readable after
a restart.

Layout: ``<root>/<namespace tag>/<number>.pack``, one pack per ``batch_set`` (see
:mod:`tierkv.storage.file_pack`: the payloads, their 48-byte headers, their keys). A batch within
``GROUP_NBYTES`` (1 MiB: a replay's backups) costs one ``open``, one ``pwritev``, one ``close`` and one
``rename``, whatever its number of pages (a larger batch: one ``pwritev`` per 1 MiB group); a file
per page cost those four calls per page, and creating and renaming a small file per page was most of a
replay's CPU (2,000 conversation requests at page 16: 128 CPU-s, 86 of them in the kernel, against 7.3
without L3). Nothing is fsynced unless ``fsync`` is set: a cache loses only hits in a crash. Pages of the
earlier one-file-per-page layout are misses here.

Writes go to a temp file beside the pack and are renamed into place, so a reader sees a whole pack or
none. A read opens each pack it needs once, reads the headers of the wanted slots' span in one ``preadv``
and each run of consecutive pages (up to 1 MiB) in one ``preadv`` straight into the caller's pages,
checksums that group in one native call (no GIL) right after it lands, while it is in cache (a page over
1 MiB: chunk by chunk), and checks the headers in one vectorised compare. Writes checksum each group right
before writing it, likewise (:mod:`tierkv.storage.file_write`). A page that fails is a miss, counted and
dropped; a pack of the wrong size (truncated, planted) is a miss for all its pages.

The pack index (which pack and slot holds each key) lives in memory: built from the packs' key lists
when the store opens, extended as it writes, and on a miss extended by the packs other processes wrote
since (found by number through the directory's pack counter, never by listing the directory).

Every pack is opened under the namespace directory's descriptor with ``O_NOFOLLOW``: a symlink planted
in the store is refused, never followed, so nothing is read or written outside it.

A disk that is full or read-only (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) stops writes for a backoff
window (``retry_backoff_s``, doubling per failure up to 64x): the writes inside it answer False at
once, and reads go on.

With ``max_bytes`` the store evicts whole packs, least recently used first (a hit refreshes its pack,
and the pack's modification time, the order after a restart), when a write takes it over the bound.
Processes sharing the directory also share a ledger of its size (:mod:`tierkv.storage.file_budget`),
so the directory as a whole stays within ``max_bytes`` plus the batches being written at that moment.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import xxhash

from tierkv.storage import native
from tierkv.storage.base import Backoff, PageStore, check_key, check_keys, check_max_bytes
from tierkv.storage.file_budget import LEDGER_NAME, DirectoryBudget
from tierkv.storage.file_pack import (
    COUNTER_NAME,
    PACK_SUFFIX,
    PackCounter,
    PackIndex,
    SLOT_BITS,
    PackInfo,
    pack_name,
    pack_number,
    pack_numbers,
    pack_trailer,
    read_pack_keys,
    read_run,
)
from tierkv.storage.file_read import PageRows, Picked, Wanted, read_payloads, wanted_by_pack
from tierkv.storage.file_write import RowRuns, write_row_runs, write_views
from tierkv.storage.page_format import (
    HEADER_SIZE,
    PageFormatError,
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted as a pack must not hang the reader (no effect on a regular file).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Write failures that the next batch would hit too: back off instead of failing batch by batch.
_DISK_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# A bounded store cuts a batch into packs of at most 1/PACK_SHARE_DIVISOR of max_bytes, so that
# evicting one pack frees a small share of the store, never most of it.
PACK_SHARE_DIVISOR = 16
# Pages are read (or written) and checksummed in groups of about this many bytes, so that the checksum
# finds each group still in the core's cache (a whole 64 MiB batch read first and hashed after is a
# second, cold pass over memory). A batch within one group is written in one call.
GROUP_NBYTES = 1 << 20
# exists maps keys in chunks of 16, 32, 64, ... up to the first miss: most lookups miss early, and
# mapping a whole 4,000-page prompt cost more than the rest of the call (dict probes into a big index)
LEADING_CHUNK_KEYS = 16
# A backup writes at least this many bytes a pack (unless backup_batch_pages says otherwise): creating and
# renaming a pack file costs ~50 us in isolation and up to 0.5 ms when ext4's inode allocation is busy,
# and a replay's 256-byte pages at HiCache's 128 pages a call made 10,566 packs of 38 KiB for 2,000
# requests, most of its system time. Larger pages keep 128 a pack (128 KiB pages: 16 MiB).
MIN_BACKUP_PACK_NBYTES = 4 << 20


class FileStore(PageStore):
    """Pages in pack files under ``root``; ``fsync`` makes each write durable before it is acknowledged."""

    name = "file"

    def __init__(self, namespace: str, page_nbytes: int, root: str, fsync: bool = False,
                 max_bytes: int | None = None, retry_backoff_s: float = 1.0,
                 page_key: bytes | str | None = None) -> None:
        super().__init__(namespace, page_nbytes, page_key)
        self.write_backoff = Backoff(retry_backoff_s)
        # The root is the operator's choice and may itself be a symlink; below it nothing is followed.
        self.root = os.path.realpath(root)
        self.fsync = fsync
        self.directory = os.path.join(self.root, self.namespace_tag)
        os.makedirs(self.directory, exist_ok=True)
        self.max_bytes = check_max_bytes(max_bytes, self.format.blob_nbytes)
        self._index = PackIndex(self.max_bytes)
        self._index_lock = threading.Lock()
        with self._namespace(create=True) as dir_fd:
            self._counter = PackCounter(dir_fd)
        self._budget = None
        if self.max_bytes is not None:
            self._budget = DirectoryBudget(self.directory, self.max_bytes, PACK_SUFFIX)
        # Checksums of a batch in one native call; a MAC (keyed store) is computed in Python.
        self._native = native.pageio if self.format.page_key is None else None
        self._rebuild_index()

    def backup_batch_pages(self) -> int:
        """HiCache's 128 pages a pack, or as many as fill MIN_BACKUP_PACK_NBYTES when pages are small."""
        return max(super().backup_batch_pages(), MIN_BACKUP_PACK_NBYTES // self.format.blob_nbytes)

    def prefetch_batch_pages(self) -> int:
        """16 pages a read, or as many as fill GROUP_NBYTES when pages are small: each read opens the
        directory, the counter and a pack, ~80 us of calls, while 16 pages of 256 bytes take ~1 us to copy."""
        return max(super().prefetch_batch_pages(), GROUP_NBYTES // self.page_nbytes)

    def path(self, key: str) -> str | None:
        """The pack file holding ``key`` (None if the store knows none); ValueError if the key is not a
        page hash."""
        check_key(key)
        with self._index_lock:
            where = self._index.locate(key)
        return None if where is None else os.path.join(self.directory, pack_name(where[0]))

    def page_extent(self, key: str) -> tuple[str, int, int] | None:
        """(pack file, offset of the payload, offset of the header) of ``key``'s page, or None."""
        check_key(key)
        with self._index_lock:
            where = self._index.locate(key)
        if where is None:
            return None
        number, slot, count = where
        return (os.path.join(self.directory, pack_name(number)), slot * self.page_nbytes,
                count * self.page_nbytes + slot * HEADER_SIZE)

    @property
    def size_bytes(self) -> int | None:
        """Bytes of the packs this store knows (bounded by ``max_bytes``); None when unbounded."""
        return None if self.max_bytes is None else self._index.size_bytes

    @contextmanager
    def _namespace(self, create: bool = False) -> Iterator[int]:
        """The namespace directory's descriptor for one batch (re-made if ``create`` and it is gone)."""
        try:
            fd = os.open(self.directory, _DIR_FLAGS)
        except FileNotFoundError:  # cleared by hand or by another process
            if not create:
                raise
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(self.directory, _DIR_FLAGS)
        try:
            yield fd
        finally:
            os.close(fd)

    # ---- finding pages ---------------------------------------------------------------------------
    def _locate(self, dir_fd: int, keys: list[str], leading: bool = False
                ) -> tuple[list[int | None], dict[int, tuple[int, int]]]:
        """The index place of each key (pack and slot, see file_pack.SLOT_BITS; None if no pack holds it),
        and (pages, bytes) of each pack named. First the packs other processes wrote since the last look
        (one read of the counter when there are none: a newer pack of a known page must win, as a newer
        file did), then, on a miss, the numbers still pending (drawn but not yet renamed then), looked up
        again only if one of them was indexed.
        ``leading``: only the leading run of present keys is wanted; the list may end after its first miss."""
        drawn = self._counter.peek()
        with self._index_lock:
            news = drawn > self._index.seen_up_to
        if news:
            self._look_for_new_packs(dir_fd, drawn)
        found, packs = self._locate_known(keys, leading)
        if None in found and not news and self._look_for_new_packs(dir_fd, drawn):
            found, packs = self._locate_known(keys, leading)
        return found, packs

    def _locate_known(self, keys: list[str], leading: bool) -> tuple[list[int | None], dict[int, tuple[int, int]]]:
        with self._index_lock:
            get = self._index.pages.get
            if leading:  # a lookup usually misses early: map growing chunks, up to the first miss
                found: list[int | None] = []
                start, size, missed = 0, LEADING_CHUNK_KEYS, False
                while start < len(keys) and not missed:
                    chunk = list(map(get, keys[start:start + size]))
                    found += chunk
                    start, size, missed = start + size, size * 2, None in chunk
            else:
                found = list(map(get, keys))  # one C call for the batch, not a tuple a key
            known = self._index.packs
            packs = {number: (len(known[number].keys), known[number].size_bytes)
                     for number in pack_numbers(found)}
            return found, packs

    def _look_for_new_packs(self, dir_fd: int, drawn: int) -> bool:
        """Index the packs drawn by others (``drawn``: the counter now) since the last look, and those
        pending, opened by number (no listing); whether any was indexed."""
        with self._index_lock:
            numbers = self._index.numbers_to_look_for(drawn)
        indexed = False
        for number in numbers:
            keys, size = self._pack_keys(dir_fd, pack_name(number))
            if keys is not None:
                with self._index_lock:
                    gone = self._index.add(number, keys, size)
                self._remove_packs(dir_fd, gone)
                indexed = True
        return indexed

    def _pack_keys(self, dir_fd: int, name: str) -> tuple[list[str] | None, int]:
        """The keys and size of pack ``name``; None if it is absent or not a whole pack."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None, 0
        except OSError as err:
            self._error(f"open {os.path.join(self.directory, name)}", err)
            return None, 0
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None, 0
            return read_pack_keys(fd, info.st_size, self.page_nbytes), info.st_size
        except OSError as err:
            self._error(f"read {os.path.join(self.directory, name)}", err)
            return None, 0
        finally:
            os.close(fd)

    def _rebuild_index(self) -> None:
        """Index the packs already in the directory, least recently used first."""
        drawn = self._counter.peek()  # before listing: a pack drawn after it is found as new
        found = []
        with self._namespace(create=True) as dir_fd:
            with os.scandir(dir_fd) as entries:
                names = [(e.name, number) for e in entries if (number := pack_number(e.name)) is not None]
            for name, number in names:
                try:
                    mtime_ns = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
                except OSError:
                    continue
                keys, size = self._pack_keys(dir_fd, name)
                if keys is not None:
                    found.append((mtime_ns, number, keys, size))
            found.sort()
            for _, number, keys, size in found:
                with self._index_lock:
                    gone = self._index.add(number, keys, size)
                self._count(evicted_pages=sum(info.live for _, info in gone))
                self._credit(self._remove_packs(dir_fd, gone))
        with self._index_lock:
            self._index.seen_up_to = max(self._index.seen_up_to, drawn)

    # ---- PageStore -------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        check_keys(keys)
        try:
            with self._namespace() as dir_fd:
                where, packs = self._locate(dir_fd, keys, leading=True)
                run = where.index(None) if None in where else len(where)
                checked = pack_numbers(where[:run])  # in order of first use: the first absent pack ends the run
                for number in checked:
                    if not self._pack_present(dir_fd, number, packs[number][1]):
                        return next(i for i in range(run) if where[i] >> SLOT_BITS == number)
        except FileNotFoundError:
            return 0
        except OSError as err:
            self._error(f"open {self.directory}", err)
            return 0
        with self._index_lock:
            for number in checked:
                self._index.touch(number)
        return run

    def _pack_present(self, dir_fd: int, number: int, size_bytes: int) -> bool:
        """Whether pack ``number`` is still a regular file of its size (another process may have evicted
        it, or it was truncated); one ``stat``, no read."""
        try:
            info = os.stat(pack_name(number), dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_size == size_bytes:
                return True
        except FileNotFoundError:
            pass
        except OSError as err:
            self._error(f"stat {os.path.join(self.directory, pack_name(number))}", err)
            return False
        with self._index_lock:
            self._index.drop_pack(number)
        return False

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        return self._get_views(keys, self._check_batch(keys, targets))

    def batch_get_rows(self, keys: list[str], rows: np.ndarray, pages: Any, **kwargs: Any) -> list[bool]:
        """Reads into runs of consecutive rows, a view a run (see file_read); a subclass's own batch_get,
        or keywords, take the general way."""
        if kwargs or type(self).batch_get is not FileStore.batch_get:
            return super().batch_get_rows(keys, rows, pages, **kwargs)
        return self._get_views(keys, PageRows(rows, self._row_index(keys, rows, pages)))

    def _get_views(self, keys: list[str], views: list[memoryview] | PageRows) -> list[bool]:
        with self._timed("get"):
            found = [False] * len(keys)
            try:
                with self._namespace() as dir_fd:
                    wheres, packs = self._locate(dir_fd, keys)
                    for number, wanted in wanted_by_pack(wheres).items():
                        self._read_pack(dir_fd, number, *packs[number], wanted, keys, views, found)
            except FileNotFoundError:
                return found
            except OSError as err:
                self._error(f"open {self.directory}", err)
                return [False] * len(keys)
            self._count(get_pages=sum(found), get_bytes=sum(found) * self.page_nbytes)
            return found

    def _read_pack(self, dir_fd: int, number: int, count: int, size_bytes: int, wanted: Wanted,
                   keys: list[str], views: list[memoryview] | PageRows, found: list[bool]) -> None:
        """Read the ``wanted`` pages of pack ``number`` (slots, batch indexes: file_read) and verify them,
        setting ``found``; a pack of the wrong size is a miss for every page wanted of it."""
        name = pack_name(number)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:  # evicted or cleared by another process
            with self._index_lock:
                self._index.drop_pack(number)
            return
        except OSError as err:  # a symlink planted in its place: refused
            self._error(f"read {os.path.join(self.directory, name)}", err)
            return
        slots, batch = wanted
        # the headers of the wanted slots' span alone: a prefetch reads a pack of a whole backup (hundreds
        # of pages) a batch of 16 at a time, and reading every header each time read them all ~40 times
        first_slot, num_headers = int(slots[0]), int(slots[-1] - slots[0]) + 1
        headers = np.zeros((num_headers, HEADER_SIZE), dtype=np.uint8)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size_bytes:
                self._reject_pack(dir_fd, number, [keys[i] for i in batch.tolist()],
                                  f"pack {name} of {info.st_size} bytes, expected {size_bytes}")
                return
            got = read_run(fd, [memoryview(headers).cast("B")], count * self.page_nbytes + first_slot * HEADER_SIZE)
            digests = read_payloads(fd, wanted, views, self.page_nbytes, GROUP_NBYTES, not self.format.keyed,
                                    self._native, self._read_large) if got == headers.nbytes else None
            complete = digests is not None
            if complete and self.max_bytes is not None:
                os.utime(fd)  # the pack's mtime is its last use: the LRU order after a restart
        except OSError as err:
            self._error(f"read {os.path.join(self.directory, name)}", err)
            return
        finally:
            os.close(fd)
        if not complete:  # shrunk while we read it
            self._reject_pack(dir_fd, number, [keys[i] for i in batch.tolist()], f"pack {name} ended early")
            return
        with self._index_lock:
            self._index.touch(number)
        self._verify(keys, views, headers, first_slot, wanted, found, digests)

    def _read_large(self, fd: int, view: memoryview, offset: int) -> int | None:
        """Read one large page and checksum it; None if the pack ends first. Unkeyed with the native module:
        ``read_xxh3`` reads it through a bounce buffer that stays in L2 and copies it into the page hashing
        from the registers it stores from, streaming past the cache (the kernel's copy straight into the
        page fetched each line of it first, and the hash read it again). Otherwise a group at a time, each
        fed to its checksum as it lands (1 MiB: a read is a system call, and lands in the core's 1 MiB L2;
        8 MiB gets with one core busy went from 0.70-0.72 to 0.76-0.77 of a plain read with 256 KiB ones)."""
        if self._native is not None:  # unkeyed (a page over a group is over read_xxh3's 240 bytes)
            return self._native.read_xxh3(fd, view, offset)
        state = None if self.format.keyed else xxhash.xxh3_64()
        for start in range(0, len(view), GROUP_NBYTES):
            chunk = view[start:start + GROUP_NBYTES]
            if read_run(fd, [chunk], offset + start) != len(chunk):
                return None
            if state is not None:
                state.update(chunk)
        return 0 if state is None else state.intdigest()

    def _verify(self, keys: list[str], views: list[memoryview] | PageRows, headers: np.ndarray, first_slot: int,
                wanted: Wanted, found: list[bool], digests: list[int]) -> None:
        """Check the pages read against their headers: unkeyed, all checksums in one call and one
        vectorised compare (a page's view made only if it fails); keyed, each MAC. A page that fails is
        rejected (and dropped)."""
        slots, batch_array = wanted
        batch = batch_array.tolist()
        sub_keys, sub_views = [keys[i] for i in batch], Picked(views, batch)
        sub_headers = headers[slots - first_slot]
        if self.format.keyed:
            ok = [self._verified(k, h.tobytes(), sub_views[j]) for j, (k, h) in enumerate(zip(sub_keys, sub_headers))]
        else:
            failures = self.format.check_headers(sub_keys, sub_headers, sub_views, digests)
            ok = [True] * len(batch)
            for index, err in failures:
                ok[index] = False
                self._reject(sub_keys[index], err)
        for i, good in zip(batch, ok):
            found[i] = good

    def _reject_pack(self, dir_fd: int, number: int, keys: list[str], why: str) -> None:
        """A pack that is not what its index entry says: each page wanted of it is a counted corrupt
        miss, and the pack is removed."""
        for key in keys:
            self._corrupt_log.warning("%s store: dropping corrupt page: %s", self.name,
                                      PageFormatError(f"page {key}: {why}"))
        self._count(corrupt_pages=len(keys))
        with self._index_lock:
            info = self._index.drop_pack(number)
        self._credit(self._remove_packs(dir_fd, [] if info is None else [(number, info)]))

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        return self._set_views(keys, self._check_batch(keys, values))

    def batch_set_rows(self, keys: list[str], rows: np.ndarray, pages: Any, **kwargs: Any) -> list[bool]:
        """Writes from runs of consecutive rows, a view a run (see file_write); a keyed store, pages over
        a group, or a subclass's own batch_set take the general way (a view a page)."""
        own_set = type(self).batch_set is FileStore.batch_set
        if kwargs or self.format.keyed or self.page_nbytes > GROUP_NBYTES or not own_set:
            return super().batch_set_rows(keys, rows, pages, **kwargs)
        return self._set_views(keys, RowRuns(rows, self._row_index(keys, rows, pages)))

    def _set_views(self, keys: list[str], views: list[memoryview] | RowRuns) -> list[bool]:
        step = len(keys) or 1
        if self.max_bytes is not None:  # a bounded store evicts whole packs: keep each a small share of it
            step = max(1, self.max_bytes // (PACK_SHARE_DIVISOR * self.format.blob_nbytes))
        if len(keys) <= step:
            return self._set_pack(keys, views)
        done: list[bool] = []
        for start in range(0, len(keys), step):
            done += self._set_pack(keys[start:start + step], views[start:start + step])
        return done

    def _set_pack(self, keys: list[str], views: list[memoryview] | RowRuns) -> list[bool]:
        """Write ``keys``' pages as one pack; all True, or all False if the write failed."""
        with self._timed("set"):
            if not self.write_backoff.ready():
                self._count(errors=len(keys))
                return [False] * len(keys)
            if not keys:
                return []
            trailer = pack_trailer(keys)
            size = len(keys) * self.format.blob_nbytes + len(trailer)
            try:
                with self._namespace(create=True) as dir_fd:
                    number = self._counter.draw()
                    with self._index_lock:
                        self._index.drew(number)
                    self._write_pack(dir_fd, number, keys, views, memoryview(trailer))
                    with self._index_lock:
                        gone = self._index.add(number, keys, size)
                    self._count(evicted_pages=sum(info.live for n, info in gone if n != number))
                    removed = self._remove_packs(dir_fd, gone)
            except OSError as err:
                self._write_failed(err, len(keys))
                return [False] * len(keys)
            self.write_backoff.succeeded()
            self._count(set_pages=len(keys), set_bytes=len(keys) * self.page_nbytes)
            self._update_ledger(size - removed)
            return [True] * len(keys)

    def _write_payloads(self, fd: int, keys: list[str], views: list[memoryview] | RowRuns,
                        trailer: memoryview) -> None:
        """Write a pack (see :mod:`tierkv.storage.file_write`)."""
        if isinstance(views, RowRuns):
            write_row_runs(fd, self.format, keys, views, trailer, GROUP_NBYTES, self._native)
        else:
            write_views(fd, self.format, keys, views, trailer, GROUP_NBYTES, self._native)

    def _write_pack(self, dir_fd: int, number: int, keys: list[str], views: list[memoryview] | RowRuns,
                    trailer: memoryview) -> None:
        """Write pack ``number`` to a temp file and rename it into place; the temp file never outlives a
        failure."""
        name = pack_name(number)
        temp = f"{name}.{os.getpid()}.tmp"
        try:
            fd = os.open(temp, _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
        except FileExistsError:  # left by a crashed process that had our pid
            os.unlink(temp, dir_fd=dir_fd)
            fd = os.open(temp, _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            try:
                self._write_payloads(fd, keys, views, trailer)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(temp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        if self.fsync:
            os.fsync(dir_fd)  # the rename is durable only once its directory entry is

    def _write_failed(self, err: OSError, num_pages: int) -> None:
        """A pack not written: one warning, an error counted per page (as the other stores count)."""
        refused = err.errno in _DISK_REFUSALS
        self._error(f"write a pack in {self.directory}" +
                    (" (disk full or read-only: writes back off)" if refused else ""), err)
        self._count(errors=num_pages - 1)
        if refused:
            self.write_backoff.failed()

    # ---- removal and capacity --------------------------------------------------------------------
    def _remove_packs(self, dir_fd: int, packs: list[tuple[int, PackInfo]]) -> int:
        """Unlink ``packs`` (already out of the index); the bytes removed."""
        removed = 0
        for number, info in packs:
            try:
                os.unlink(pack_name(number), dir_fd=dir_fd)
                removed += info.size_bytes
            except FileNotFoundError:
                pass
            except OSError as err:
                self._error(f"remove {os.path.join(self.directory, pack_name(number))}", err)
        return removed

    def _drop(self, key: str) -> None:
        """A corrupt page: out of the index, and its pack removed once no live page is left in it."""
        with self._index_lock:
            gone = self._index.drop_page(key)
        if gone is None:
            return
        try:
            with self._namespace() as dir_fd:
                self._credit(self._remove_packs(dir_fd, [gone]))
        except OSError as err:
            self._error(f"remove corrupt page {key}", err)

    def _credit(self, num_bytes: int) -> None:
        """Uncount pack bytes this process just removed."""
        self._update_ledger(-num_bytes)

    def _update_ledger(self, num_bytes: int) -> None:
        """Count pack bytes just written (or removed) in the directory's shared ledger."""
        if self._budget is None or not num_bytes:
            return
        try:
            removed = self._budget.charge(num_bytes)
        except OSError as err:
            self._error(f"size ledger of {self.directory}", err)
            return
        self._count(evicted_pages=removed)

    def clear(self) -> None:
        """Remove this namespace's pages; symlinks inside are removed, never followed."""
        try:
            with self._namespace(create=True) as fd:
                for entry in os.scandir(fd):
                    if entry.is_dir(follow_symlinks=False):  # the one-file-per-page layout's subdirectories
                        shutil.rmtree(entry.name, dir_fd=fd, ignore_errors=True)
                    elif entry.name not in (LEDGER_NAME, COUNTER_NAME):  # shared: reset or kept below
                        os.unlink(entry.name, dir_fd=fd)
        except OSError as err:
            self._error(f"clear {self.directory}", err)
        with self._index_lock:
            self._index.clear()
        if self._budget is not None:
            try:
                self._budget.reset()
            except OSError as err:
                self._error(f"clear {self.directory}", err)

    def close(self) -> None:
        super().close()
        self._counter.close()
