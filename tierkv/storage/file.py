"""Page store on a local directory: one file per page, written atomically, readable after a restart.

Layout: ``<root>/<namespace tag>/<key[0:2]>/<key[2:4]>/<key>.page``, each file the payload then the
48-byte header (see :mod:`tierkv.storage.page_format`). Writes go to a per-thread temp file beside
the target and are renamed over it, so a reader sees a whole old page, a whole new page or none.
Reads land straight in the caller's page tensor (``preadv``), writes go straight from it
(``pwrite``): no staging copy on either side; both run in cache-sized chunks, checksumming each
chunk while it is hot.

Every path below the namespace directory is walked one component at a time under directory file
descriptors with ``O_NOFOLLOW``: a symlink planted anywhere inside the store (a subdirectory or a
page) is refused, never followed, so nothing is read or written outside the store.

A disk that is full or read-only (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) stops writes for a backoff
window (``retry_backoff_s``, doubling per failure up to 64x): the writes inside it answer False at
once, and reads go on.

With ``max_bytes`` the store keeps an LRU index of its pages (rebuilt from the directory at start,
ordered by modification time, which a hit refreshes) and removes the least recently used pages when a
write takes it over the bound.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import xxhash

from tierkv.storage.base import Backoff, LruIndex, PageStore, check_key, check_max_bytes, is_key
from tierkv.storage.page_format import HEADER_SIZE

PAGE_SUFFIX = ".page"
# Reads and writes go in chunks this size, each checksummed while still in cache: small enough to stay
# in L2/L3, large enough that the extra syscalls cost nothing measurable (best of 256 KiB-64 MiB here).
IO_CHUNK_NBYTES = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# Write failures that the next page would hit too: back off instead of failing page by page.
_DISK_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def write_with_checksum(fd: int, payload: memoryview, offset: int, state: Any = None) -> Any:
    """Write ``payload`` at ``offset`` chunk by chunk, feeding each chunk to ``state`` (a payload hasher,
    xxh3-64 if None) while it is in cache; return the hasher."""
    state = xxhash.xxh3_64() if state is None else state
    for start in range(0, len(payload), IO_CHUNK_NBYTES):
        chunk = payload[start:start + IO_CHUNK_NBYTES]
        state.update(chunk)
        _write_all(fd, chunk, offset + start)
    return state


def read_with_checksum(fd: int, payload: memoryview, offset: int, state: Any = None) -> tuple[int, Any]:
    """Read into ``payload`` from ``offset`` chunk by chunk; (bytes read, the hasher fed with them)."""
    state = xxhash.xxh3_64() if state is None else state
    done = 0
    while done < len(payload):
        chunk = payload[done:done + IO_CHUNK_NBYTES]
        got = os.preadv(fd, [chunk], offset + done)
        if got == 0:
            break
        state.update(chunk[:got])
        done += got
    return done, state


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
        self.max_bytes = check_max_bytes(max_bytes, self.format.blob_nbytes)
        self._index = LruIndex(self.max_bytes) if self.max_bytes is not None else None
        self._index_lock = threading.Lock()
        if self._index is not None:
            self._rebuild_index()

    def path(self, key: str) -> str:
        """The file of ``key``; ValueError if the key is not a page hash or the path leaves the store."""
        check_key(key)
        path = os.path.normpath(os.path.join(self.directory, key[:2], key[2:4], key + PAGE_SUFFIX))
        if os.path.commonpath([path, self.directory]) != self.directory:
            raise ValueError(f"page key {key!r} maps outside the store directory {self.directory}")
        return path

    @property
    def size_bytes(self) -> int | None:
        """Bytes of the pages this store knows (bounded by ``max_bytes``); None when unbounded."""
        return None if self._index is None else self._index.size_bytes

    # ---- directory walking without following symlinks -------------------------------------------
    @contextmanager
    def _leaf_dir(self, key: str, create: bool) -> Iterator[int | None]:
        """A descriptor of ``key``'s leaf directory (None if absent and not ``create``).

        Each component is opened with O_NOFOLLOW under its parent's descriptor, so a symlink anywhere
        below the root raises OSError (ELOOP or ENOTDIR) instead of leading outside the store.
        """
        fd = os.open(self.directory, _DIR_FLAGS) if not create else self._open_namespace_dir()
        try:
            for part in (key[:2], key[2:4]):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        fd = None
                        break
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _open_namespace_dir(self) -> int:
        try:
            return os.open(self.directory, _DIR_FLAGS)
        except FileNotFoundError:  # cleared by hand or by another process
            os.makedirs(self.directory, exist_ok=True)
            return os.open(self.directory, _DIR_FLAGS)

    # ---- PageStore -------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        for key in keys:
            check_key(key)
        for i, key in enumerate(keys):
            if not self._exists_one(key):
                return i
        return len(keys)

    def _exists_one(self, key: str) -> bool:
        try:
            with self._leaf_dir(key, create=False) as leaf:
                if leaf is None:
                    return False
                info = os.stat(key + PAGE_SUFFIX, dir_fd=leaf, follow_symlinks=False)
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
            return [self._get_one(key, view) for key, view in zip(keys, views)]

    def _get_one(self, key: str, view: memoryview) -> bool:
        header = bytearray(HEADER_SIZE)
        read, state = 0, None
        try:
            with self._leaf_dir(key, create=False) as leaf:
                if leaf is None:
                    return False
                fd = os.open(key + PAGE_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=leaf)
            try:
                size = os.fstat(fd).st_size
                if size == self.format.blob_nbytes and os.preadv(fd, [header], self.page_nbytes) == HEADER_SIZE:
                    read, state = read_with_checksum(fd, view, 0, self.format.payload_hasher(key))
                if self._index is not None:
                    os.utime(fd)  # the page's mtime is its last use: the LRU order after a restart
            finally:
                os.close(fd)
        except FileNotFoundError:
            return False
        except OSError as err:
            self._error(f"read {self.path(key)}", err)
            return False
        # A short or oversized file fails verify on its length (the header then names the expected one).
        if not self._verified(key, header, view[:read], state if read == len(view) else None):
            return False
        self._indexed(key)
        self._count(get_pages=1, get_bytes=self.page_nbytes)
        return True

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, values)
        with self._timed("set"):
            return [self._set_one(key, view) for key, view in zip(keys, views)]

    def _set_one(self, key: str, view: memoryview) -> bool:
        if not self.write_backoff.ready():
            self._count(errors=1)
            return False
        name = key + PAGE_SUFFIX
        temp = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with self._leaf_dir(key, create=True) as leaf:
                self._write_page(leaf, key, name, temp, view)
        except OSError as err:
            refused = err.errno in _DISK_REFUSALS
            self._error(f"write {self.path(key)}" + (" (disk full or read-only: writes back off)" if refused
                                                     else ""), err)
            if refused:
                self.write_backoff.failed()
            return False
        self.write_backoff.succeeded()
        self._count(set_pages=1, set_bytes=self.page_nbytes)
        self._stored(key)
        return True

    def _write_page(self, leaf: int, key: str, name: str, temp: str, view: memoryview) -> None:
        """Write ``temp`` under ``leaf`` and rename it over ``name``; the temp file never outlives a failure."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(temp, flags, 0o644, dir_fd=leaf)
        except FileExistsError:  # left by a crashed process that had our pid and thread id
            os.unlink(temp, dir_fd=leaf)
            fd = os.open(temp, flags, 0o644, dir_fd=leaf)
        try:
            try:
                # The checksum comes from the same cache-hot pass as the write.
                state = write_with_checksum(fd, view, 0, self.format.payload_hasher(key))
                _write_all(fd, memoryview(self.format.header(key, view, state)), self.page_nbytes)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # rename() replaces a planted symlink itself; it never writes through one.
            os.replace(temp, name, src_dir_fd=leaf, dst_dir_fd=leaf)
        except BaseException:
            try:
                os.unlink(temp, dir_fd=leaf)
            except OSError:
                pass
            raise
        if self.fsync:
            os.fsync(leaf)  # the rename is durable only once its directory entry is

    def _remove(self, key: str) -> None:
        """Unlink ``key``'s page (missing is fine); raises OSError on any other failure."""
        try:
            with self._leaf_dir(key, create=False) as leaf:
                if leaf is not None:
                    os.unlink(key + PAGE_SUFFIX, dir_fd=leaf)
        except FileNotFoundError:
            pass

    def _drop(self, key: str) -> None:
        self._forget(key)
        try:
            self._remove(key)
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
                else:
                    os.unlink(entry.name, dir_fd=fd)
        except OSError as err:
            self._error(f"clear {self.directory}", err)
        finally:
            os.close(fd)
        if self._index is not None:
            with self._index_lock:
                self._index.clear()

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
        for victim in victims:
            try:
                self._remove(victim)
            except OSError as err:
                self._error(f"evict page {victim}", err)
        if victims:
            self._count(evicted_pages=len(victims))

    def _forget(self, key: str) -> None:
        if self._index is not None:
            with self._index_lock:
                self._index.remove(key)

    def _rebuild_index(self) -> None:
        """Index the pages already on disk, least recently used first (one scandir per directory)."""
        found: list[tuple[float, str]] = []
        for top in _subdirs(self.directory):
            for leaf in _subdirs(top):
                with os.scandir(leaf) as entries:
                    for entry in entries:
                        key = entry.name[:-len(PAGE_SUFFIX)]
                        if (entry.name.endswith(PAGE_SUFFIX) and is_key(key)
                                and entry.is_file(follow_symlinks=False)):
                            found.append((entry.stat(follow_symlinks=False).st_mtime, key))
        found.sort()
        for _, key in found:
            self._stored(key)


def _subdirs(directory: str) -> list[str]:
    with os.scandir(directory) as entries:
        return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
