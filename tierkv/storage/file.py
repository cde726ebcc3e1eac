"""Page store on a local directory: one file per page, written atomically, readable after a restart.

Layout: ``<root>/<namespace tag>/<key[0:2]>/<key>.page``, each file the payload then the 48-byte
header (see :mod:`tierkv.storage.page_format`). The 256 subdirectories are made with the store (and
again after a clear), never per page: a page costs one open, one write and one rename, and a read one
open and one read. (Stores of earlier versions used two levels, ``<key[0:2]>/<key[2:4]>/``: a
directory per few pages made a ``mkdir`` part of most writes; their pages are misses here.)

Writes go to a per-thread temp file beside the target and are renamed over it, so a reader sees a
whole old page, a whole new page or none. Reads land straight in the caller's page tensor (``preadv``
of payload and header at once), writes go straight from it (``pwritev``): no staging copy on either
side. Each chunk of a page is checksummed right before it is written or right after it is read, while
it is in the core's cache. With the native page I/O (:mod:`tierkv.storage.native`) a whole batch is
one call without the GIL: per page that saves ~15 us of Python (open, read, close, hasher, header
check), half the time of a 128 KiB read; keyed stores (a MAC) and builds without it use the Python loop.
A large batch is read, or written, on several native threads, each page read and hashed (or hashed and
written) by one of them, so with a spare core the hash of one page runs beside the kernel's copy of
another.

Every path below the namespace directory is opened one component at a time under directory file
descriptors with ``O_NOFOLLOW``: a symlink planted anywhere inside the store (a subdirectory or a
page) is refused, never followed, so nothing is read or written outside the store.

A disk that is full or read-only (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) stops writes for a backoff
window (``retry_backoff_s``, doubling per failure up to 64x): the writes inside it answer False at
once, and reads go on.

With ``max_bytes`` the store keeps an LRU index of its pages (rebuilt from the directory at start,
ordered by modification time, which a hit refreshes) and removes the least recently used pages when a
write takes it over the bound. Processes sharing the directory also share a ledger of its size
(:mod:`tierkv.storage.file_budget`), so the directory as a whole stays within ``max_bytes`` plus the
batches being written at that moment.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch

from tierkv.storage import native
from tierkv.storage.base import Backoff, LruIndex, PageStore, check_key, check_max_bytes, is_key
from tierkv.storage.file_budget import LEDGER_NAME, DirectoryBudget
from tierkv.storage.page_format import CHECKSUM_OFFSET, CHUNK_NBYTES, HEADER_SIZE, Digest, PageFormatError

PAGE_SUFFIX = ".page"
SUBDIR_CHARS = 2  # pages spread over 16**2 subdirectories named by their key's first hex digits
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# Write failures that the next page would hit too: back off instead of failing page by page.
_DISK_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# Native read results (tierkv/_pageio.c) and the directory descriptors that stand for a missing or
# unusable subdirectory.
_READ_OK, _READ_ABSENT, _READ_BAD_SIZE, _READ_MISMATCH, _READ_SHORT, _READ_NO_DIR = range(6)
_WRITE_SKIPPED = 1
_NO_SUBDIR, _BAD_SUBDIR = -1, -2
# Native reads of a batch spread over this many threads (at most one per usable core), each page read
# and hashed by one: with a spare core the kernel's copy of one page overlaps the hash of another. A
# batch under PARALLEL_READ_MIN_NBYTES stays on the calling thread (a thread costs ~30 us to start).
MAX_READ_THREADS = 4
PARALLEL_READ_MIN_NBYTES = 2 << 20
# Native writes of a batch likewise: cut into one run of pages per thread (the calling thread takes the
# first), each run one native call that hashes each chunk just before writing it; the kernel's copy
# into the page cache and the hash are both CPU work, which a spare core halves.
PARALLEL_WRITE_MIN_NBYTES = 2 << 20


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write ``buffers`` back to back from ``offset``: one ``pwritev`` unless the kernel takes less."""
    while buffers:
        written = os.pwritev(fd, buffers, offset)
        offset += written
        while buffers and written >= len(buffers[0]):
            written -= len(buffers[0])
            buffers = buffers[1:]
        if buffers and written:
            buffers = [buffers[0][written:], *buffers[1:]]


def write_page(fd: int, payload: memoryview, state: Any, header: Callable[[Any], bytes]) -> None:
    """Write ``payload`` then ``header(state)`` at offset 0, chunk by chunk, feeding each chunk to ``state``
    (its payload hasher) just before writing it, while it is in cache; the last chunk and the header go
    in one call (a page of one chunk: one write)."""
    last = max(0, len(payload) - 1) // CHUNK_NBYTES * CHUNK_NBYTES
    for start in range(0, last, CHUNK_NBYTES):
        chunk = payload[start:start + CHUNK_NBYTES]
        state.update(chunk)
        _write_all(fd, [chunk], start)
    state.update(payload[last:])
    _write_all(fd, [payload[last:], memoryview(header(state))], last)


def read_page(fd: int, payload: memoryview, header: memoryview, state: Any) -> int:
    """Read ``payload`` then ``header`` from offset 0, chunk by chunk, feeding each payload chunk to
    ``state`` while it is in cache (the last chunk and the header in one call); the bytes read."""
    done = 0
    total = len(payload) + len(header)
    while done < total:
        end = done + CHUNK_NBYTES
        buffers = [payload[done:end]] + ([header[max(0, done - len(payload)):]] if end >= len(payload) else [])
        got = os.preadv(fd, buffers, done)
        if got == 0:
            break
        if done < len(payload):
            state.update(payload[done:min(done + got, len(payload))])
        done += got
    return done


class FileStore(PageStore):
    """Pages as files under ``root``; ``fsync`` makes each write durable before it is acknowledged."""

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
        self._make_subdirs()
        self.max_bytes = check_max_bytes(max_bytes, self.format.blob_nbytes)
        self._index = LruIndex(self.max_bytes) if self.max_bytes is not None else None
        self._index_lock = threading.Lock()
        self._budget = None
        if self._index is not None:
            self._budget = DirectoryBudget(self.directory, self.max_bytes, PAGE_SUFFIX)
            self._rebuild_index()
        # The native batch I/O checks xxh3 checksums only; a MAC is computed in Python.
        self._native = native.pageio if self.format.page_key is None else None
        self.read_threads = min(MAX_READ_THREADS, usable_cores())
        self.parallel_read_min_nbytes = PARALLEL_READ_MIN_NBYTES
        self.write_threads = self.read_threads
        self.parallel_write_min_nbytes = PARALLEL_WRITE_MIN_NBYTES

    def path(self, key: str) -> str:
        """The file of ``key``; ValueError if the key is not a page hash or the path leaves the store."""
        check_key(key)
        path = os.path.normpath(os.path.join(self.directory, key[:SUBDIR_CHARS], key + PAGE_SUFFIX))
        if os.path.commonpath([path, self.directory]) != self.directory:
            raise ValueError(f"page key {key!r} maps outside the store directory {self.directory}")
        return path

    @property
    def size_bytes(self) -> int | None:
        """Bytes of the pages this store knows (bounded by ``max_bytes``); None when unbounded."""
        return None if self._index is None else self._index.size_bytes

    # ---- directories, opened without following symlinks ----------------------------------------
    def _make_subdirs(self) -> None:
        """Create the subdirectories that are missing (one pass; a planted symlink is left to fail at use)."""
        fd = self._open_namespace_dir()
        try:
            for i in range(16 ** SUBDIR_CHARS):
                try:
                    os.mkdir(f"{i:0{SUBDIR_CHARS}x}", 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
        finally:
            os.close(fd)

    def _open_namespace_dir(self) -> int:
        try:
            return os.open(self.directory, _DIR_FLAGS)
        except FileNotFoundError:  # cleared by hand or by another process
            os.makedirs(self.directory, exist_ok=True)
            return os.open(self.directory, _DIR_FLAGS)

    @contextmanager
    def _namespace(self, create: bool) -> Iterator["_Subdirs"]:
        """The directories of one batch: the namespace's (None if it is gone and not ``create``) and
        each subdirectory the batch touches, opened once."""
        try:
            fd = self._open_namespace_dir() if create else os.open(self.directory, _DIR_FLAGS)
        except FileNotFoundError:
            fd = None
        dirs = _Subdirs(fd, create)
        try:
            yield dirs
        finally:
            dirs.close()

    @staticmethod
    def _subdir(namespace_fd: int, key: str, create: bool) -> int | None:
        """A descriptor of ``key``'s subdirectory, for the caller to close (None if absent and not
        ``create``). O_NOFOLLOW: a symlink in its place raises OSError (ELOOP or ENOTDIR)."""
        part = key[:SUBDIR_CHARS]
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=namespace_fd)
        except FileNotFoundError:
            if not create:
                return None
        try:
            os.mkdir(part, 0o755, dir_fd=namespace_fd)  # removed by hand since the store made it
        except FileExistsError:
            pass
        return os.open(part, _DIR_FLAGS, dir_fd=namespace_fd)

    # ---- PageStore -------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        for key in keys:
            check_key(key)
        try:
            with self._namespace(create=False) as dirs:
                for i, key in enumerate(keys):
                    if not self._exists_one(dirs, key):
                        return i
        except OSError as err:
            self._error(f"open {self.directory}", err)
            return 0
        return len(keys)

    def _exists_one(self, dirs: "_Subdirs", key: str) -> bool:
        try:
            sub = dirs.get(key)
            if sub is None:
                return False
            info = os.stat(key + PAGE_SUFFIX, dir_fd=sub, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as err:
            self._error(f"stat {self.path(key)}", err)
            return False
        found = stat.S_ISREG(info.st_mode) and info.st_size == self.format.blob_nbytes
        if found:
            self._indexed(key)
        return found

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, targets)
        with self._timed("get"):
            try:
                with self._namespace(create=False) as dirs:
                    if self._native is not None:
                        found = self._get_native(dirs, keys, views)
                    else:
                        found = [self._get_one(dirs, key, view) for key, view in zip(keys, views)]
            except OSError as err:
                self._error(f"open {self.directory}", err)
                return [False] * len(keys)
            self._count(get_pages=sum(found), get_bytes=sum(found) * self.page_nbytes)
            return found

    @staticmethod
    def _open_page(dirs: "_Subdirs", key: str) -> int | None:
        """A read descriptor of ``key``'s page, None if absent; OSError for a symlink on the way."""
        sub = dirs.get(key)
        # O_NONBLOCK: a FIFO planted as a page must not hang the reader (no effect on a regular file).
        return None if sub is None else os.open(key + PAGE_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK,
                                                dir_fd=sub)

    def _get_one(self, dirs: "_Subdirs", key: str, view: memoryview) -> bool:
        header = bytearray(HEADER_SIZE)
        state = self.format.payload_hasher(key)
        try:
            fd = self._open_page(dirs, key)
            if fd is None:
                return False
            try:
                size = os.fstat(fd).st_size
                read = read_page(fd, view, memoryview(header), state) if size == self.format.blob_nbytes else 0
                if self._index is not None:
                    os.utime(fd)  # the page's mtime is its last use: the LRU order after a restart
            finally:
                os.close(fd)
        except FileNotFoundError:
            return False
        except OSError as err:
            self._error(f"read {self.path(key)}", err)
            return False
        if read != self.format.blob_nbytes:
            self._reject(key, PageFormatError(f"page {key}: file of {size} bytes, expected "
                                              f"{self.format.blob_nbytes}"))
            return False
        if not self._verified(key, header, view, state):
            return False
        self._indexed(key)
        return True

    def _subdir_fds(self, dirs: "_Subdirs", keys: list[str], what: str) -> list[int]:
        """Each key's subdirectory descriptor for the native calls: ``_NO_SUBDIR`` if absent,
        ``_BAD_SUBDIR`` if it cannot be opened (a symlink in its place: counted here)."""
        fds = []
        for key in keys:
            try:
                sub = dirs.get(key)
            except OSError as err:
                self._error(f"{what} {self.path(key)}", err)
                sub = _BAD_SUBDIR
            fds.append(_NO_SUBDIR if sub is None else sub)
        return fds

    def _get_native(self, dirs: "_Subdirs", keys: list[str], views: list[memoryview]) -> list[bool]:
        """The batch in one native call: each page read, hashed chunk by chunk as it lands and its header
        compared with what it must hold; pages that fail are explained, rejected and dropped here.

        Checked in place, not in helpers: here the chunk is still in cache, in a helper it is a cold pass
        over memory plus a hand-off, and on a busy 2-core machine helpers cost more than they hide (both
        side by side at load 4.9: 8 MiB gets 0.49 of raw with helpers, 0.78 in place). Large batches are
        spread over ``read_threads`` native threads instead, each page still read and hashed by one."""
        headers = np.zeros((len(keys), HEADER_SIZE), dtype=np.uint8)
        threads = self.read_threads if len(keys) * self.page_nbytes >= self.parallel_read_min_nbytes else 1
        results = self._native.read_pages(
            self._subdir_fds(dirs, keys, "read"), [(key + PAGE_SUFFIX).encode() for key in keys], views, headers,
            self.format.header_templates(keys), self.page_nbytes, CHUNK_NBYTES, CHECKSUM_OFFSET,
            self._index is not None,  # touch: a hit refreshes the page's mtime, the LRU order after a restart
            threads)
        found = [status == _READ_OK for status, _ in results]
        for i, (status, value) in enumerate(results):
            if status != _READ_OK:
                self._read_failed(keys[i], status, value, headers[i], views[i])
            elif self._index is not None:
                self._indexed(keys[i])
        return found

    def _read_failed(self, key: str, status: int, value: int, header: np.ndarray, view: memoryview) -> None:
        """A page a native read did not get: a bad one is rejected (and dropped), an error counted."""
        if status in (_READ_BAD_SIZE, _READ_SHORT):
            self._reject(key, PageFormatError(f"page {key}: file of {value} bytes, expected "
                                              f"{self.format.blob_nbytes}"))
        elif status == _READ_MISMATCH:
            if self._verified(key, header.tobytes(), view, Digest(value)):  # names the field that differs
                self._reject(key, PageFormatError(f"page {key}: header differs from its expected bytes"))
        elif status < 0:
            self._error(f"read {self.path(key)}", OSError(-status, os.strerror(-status)))

    def _set_native(self, dirs: "_Subdirs", keys: list[str], views: list[memoryview]) -> list[bool]:
        """The batch in native calls (each chunk hashed just before it is written, the checksum put into
        the page's header template), one per run of ``write_threads`` runs when the batch is large; a disk
        refusal stops its run and backs off."""
        fds = self._subdir_fds(dirs, keys, "write")
        threads = self.write_threads if len(keys) * self.page_nbytes >= self.parallel_write_min_nbytes else 1
        bounds = [len(keys) * k // threads for k in range(threads + 1)]
        runs = [(bounds[k], bounds[k + 1]) for k in range(threads) if bounds[k] < bounds[k + 1]]
        if not runs:  # an empty batch
            return []
        results: list = [None] * len(runs)

        def write_run(k: int) -> None:
            start, end = runs[k]
            results[k] = self._write_run(fds[start:end], keys[start:end], views[start:end])
        helpers = [threading.Thread(target=write_run, args=(k,), name="tierkv-file-write", daemon=True)
                   for k in range(1, len(runs))]
        for helper in helpers:
            helper.start()
        try:
            write_run(0)
        finally:
            for helper in helpers:  # their pages' views are the caller's: never return before they end
                helper.join()
        # a helper that raised (threading printed why) leaves its run's pages unacknowledged
        results = [run if run is not None else [(_WRITE_SKIPPED, 0)] * (end - start)
                   for run, (start, end) in zip(results, runs)]
        return self._settle_writes(keys, fds, [r for run in results for r in run])

    def _write_run(self, fds: list[int], keys: list[str], views: list[memoryview]) -> list:
        """One native call over ``keys`` (safe on any thread: no Python state is touched); its results."""
        suffix = f"{PAGE_SUFFIX}.{os.getpid()}.{threading.get_ident()}.tmp"  # each thread its own temp files
        return self._native.write_pages(
            fds, [(key + suffix).encode() for key in keys], [(key + PAGE_SUFFIX).encode() for key in keys], views,
            self.format.header_templates(keys), self.page_nbytes, CHUNK_NBYTES, CHECKSUM_OFFSET, self.fsync,
            sorted(_DISK_REFUSALS))

    def _settle_writes(self, keys: list[str], fds: list[int], results: list) -> list[bool]:
        """Count, index and explain the native results of a batch, on the calling thread."""
        done = [status == 0 for status, _ in results]
        if any(done):  # before the failures: a refusal (which ends the batch) must leave writes backing off
            self.write_backoff.succeeded()
            self._count(set_pages=sum(done), set_bytes=sum(done) * self.page_nbytes)
        for key, fd, ok, (status, _) in zip(keys, fds, done, results):
            if ok:
                self._stored(key)
            elif status == _WRITE_SKIPPED:
                self._count(errors=1)
            elif fd != _BAD_SUBDIR:  # that one was counted when its directory failed to open
                self._write_failed(key, OSError(-status, os.strerror(-status)))
        return done

    def _write_failed(self, key: str, err: OSError) -> None:
        refused = err.errno in _DISK_REFUSALS
        self._error(f"write {self.path(key)}" + (" (disk full or read-only: writes back off)" if refused else ""),
                    err)
        if refused:
            self.write_backoff.failed()

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, values)
        with self._timed("set"):
            if not self.write_backoff.ready():
                self._count(errors=len(keys))
                return [False] * len(keys)
            try:
                with self._namespace(create=True) as dirs:
                    if self._native is not None:
                        done = self._set_native(dirs, keys, views)
                    else:
                        done = [self._set_one(dirs, key, view) for key, view in zip(keys, views)]
            except OSError as err:
                self._error(f"open {self.directory}", err)
                return [False] * len(keys)
            self._charge(sum(done))
            return done

    def _charge(self, num_pages: int) -> None:
        """Count pages just written in the directory's shared ledger (other processes write there too)."""
        self._update_ledger(num_pages)

    def _credit(self, num_pages: int) -> None:
        """Uncount pages this process just removed."""
        self._update_ledger(-num_pages)

    def _update_ledger(self, num_pages: int) -> None:
        if self._budget is None or not num_pages:
            return
        try:
            removed = self._budget.charge(num_pages * self.format.blob_nbytes)
        except OSError as err:
            self._error(f"size ledger of {self.directory}", err)
            return
        self._count(evicted_pages=removed)

    def _set_one(self, dirs: "_Subdirs", key: str, view: memoryview) -> bool:
        if not self.write_backoff.ready():
            self._count(errors=1)
            return False
        name = key + PAGE_SUFFIX
        temp = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self._write_page(dirs.get(key), key, temp, view)
        except OSError as err:
            self._write_failed(key, err)
            return False
        self.write_backoff.succeeded()
        self._count(set_pages=1, set_bytes=self.page_nbytes)
        self._stored(key)
        return True

    def _write_page(self, sub: int, key: str, temp: str, view: memoryview) -> None:
        """Write ``temp`` under ``sub`` and rename it over ``key``'s page; the temp file never outlives a
        failure."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(temp, flags, 0o644, dir_fd=sub)
        except FileExistsError:  # left by a crashed process that had our pid and thread id
            os.unlink(temp, dir_fd=sub)
            fd = os.open(temp, flags, 0o644, dir_fd=sub)
        try:
            try:
                # The checksum comes from the same cache-hot pass as the write.
                write_page(fd, view, self.format.payload_hasher(key),
                           lambda state: self.format.header(key, view, state))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # rename() replaces a planted symlink itself; it never writes through one.
            os.replace(temp, key + PAGE_SUFFIX, src_dir_fd=sub, dst_dir_fd=sub)
        except BaseException:
            try:
                os.unlink(temp, dir_fd=sub)
            except OSError:
                pass
            raise
        if self.fsync:
            os.fsync(sub)  # the rename is durable only once its directory entry is

    def _remove(self, key: str) -> bool:
        """Unlink ``key``'s page; False if it was missing; raises OSError on any other failure."""
        try:
            with self._namespace(create=False) as dirs:
                sub = dirs.get(key)
                if sub is not None:
                    os.unlink(key + PAGE_SUFFIX, dir_fd=sub)
                    return True
        except FileNotFoundError:
            pass
        return False

    def _drop(self, key: str) -> None:
        self._forget(key)
        try:
            self._credit(int(self._remove(key)))
        except OSError as err:
            self._error(f"remove corrupt page {key}", err)

    def clear(self) -> None:
        """Remove this namespace's pages; symlinks inside are removed, never followed."""
        try:
            fd = self._open_namespace_dir()
        except OSError as err:
            self._error(f"clear {self.directory}", err)
            return
        try:
            for entry in os.scandir(fd):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.name, dir_fd=fd, ignore_errors=True)
                elif entry.name != LEDGER_NAME:  # other processes hold its lock: it is reset below
                    os.unlink(entry.name, dir_fd=fd)
        except OSError as err:
            self._error(f"clear {self.directory}", err)
        finally:
            os.close(fd)
        try:
            self._make_subdirs()
        except OSError as err:
            self._error(f"clear {self.directory}", err)
        if self._index is not None:
            with self._index_lock:
                self._index.clear()
        if self._budget is not None:
            try:
                self._budget.reset()
            except OSError as err:
                self._error(f"clear {self.directory}", err)

    # ---- capacity --------------------------------------------------------------------------------
    def _indexed(self, key: str) -> None:
        """A page seen on disk: the most recent one now (another process may have written it)."""
        if self._index is None:
            return
        with self._index_lock:
            known = key in self._index
            if known:
                self._index.touch(key)
        if not known:
            self._stored(key)

    def _stored(self, key: str) -> None:
        if self._index is None:
            return
        with self._index_lock:
            victims = self._index.add(key, self.format.blob_nbytes)
        removed = 0
        for victim in victims:
            try:
                removed += self._remove(victim)
            except OSError as err:
                self._error(f"evict page {victim}", err)
        if victims:
            self._count(evicted_pages=len(victims))
            self._credit(removed)

    def _forget(self, key: str) -> None:
        if self._index is not None:
            with self._index_lock:
                self._index.remove(key)

    def _rebuild_index(self) -> None:
        """Index the pages already on disk, least recently used first (one scandir per directory)."""
        found: list[tuple[float, str]] = []
        for sub in _subdirs(self.directory):
            with os.scandir(sub) as entries:
                for entry in entries:
                    key = entry.name[:-len(PAGE_SUFFIX)]
                    if entry.name.endswith(PAGE_SUFFIX) and is_key(key) and entry.is_file(follow_symlinks=False):
                        found.append((entry.stat(follow_symlinks=False).st_mtime, key))
        found.sort()
        for _, key in found:
            self._stored(key)


class _Subdirs:
    """The subdirectory descriptors of one batch, each opened on first use and closed with the batch
    (a page's own open then costs one ``open``, not two)."""

    def __init__(self, namespace_fd: int | None, create: bool) -> None:
        self.namespace_fd, self.create = namespace_fd, create
        self._fds: dict[str, int | None] = {}

    def get(self, key: str) -> int | None:
        """``key``'s subdirectory (None if absent and not ``create``); OSError for a symlink in its place."""
        part = key[:SUBDIR_CHARS]
        if part not in self._fds:
            self._fds[part] = (None if self.namespace_fd is None
                               else FileStore._subdir(self.namespace_fd, key, self.create))
        return self._fds[part]

    def close(self) -> None:
        for fd in [*self._fds.values(), self.namespace_fd]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()


def _subdirs(directory: str) -> list[str]:
    with os.scandir(directory) as entries:
        return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
