"""Page store on a local directory: one file per page, written atomically, readable after a restart.

Layout: ``<root>/<namespace tag>/<key[0:2]>/<key[2:4]>/<key>.page``, each file the payload then the
48-byte header (see :mod:`tierkv.storage.page_format`). Writes go to a per-thread temp file beside
the target and are renamed over it, so a reader sees a whole old page, a whole new page or none.
Reads land straight in the caller's page tensor (``preadv``), writes go straight from it
(``pwrite``): no staging copy on either side; both run in cache-sized chunks, checksumming each
chunk while it is hot.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading

import torch
import xxhash

from tierkv.storage.base import PageStore, check_key
from tierkv.storage.page_format import HEADER_SIZE

PAGE_SUFFIX = ".page"
# Reads and writes go in chunks this size, each checksummed while still in cache: small enough to stay
# in L2/L3, large enough that the extra syscalls cost nothing measurable (best of 256 KiB-64 MiB here).
IO_CHUNK_NBYTES = 1 << 20


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def write_with_checksum(fd: int, payload: memoryview, offset: int) -> int:
    """Write ``payload`` at ``offset`` chunk by chunk, hashing each chunk while it is in cache."""
    state = xxhash.xxh3_64()
    for start in range(0, len(payload), IO_CHUNK_NBYTES):
        chunk = payload[start:start + IO_CHUNK_NBYTES]
        state.update(chunk)
        _write_all(fd, chunk, offset + start)
    return state.intdigest()


def read_with_checksum(fd: int, payload: memoryview, offset: int) -> tuple[int, int]:
    """Read into ``payload`` from ``offset`` chunk by chunk; (bytes read, checksum of them)."""
    state = xxhash.xxh3_64()
    done = 0
    while done < len(payload):
        chunk = payload[done:done + IO_CHUNK_NBYTES]
        got = os.preadv(fd, [chunk], offset + done)
        if got == 0:
            break
        state.update(chunk[:got])
        done += got
    return done, state.intdigest()


class FileStore(PageStore):
    """Pages as files under ``root``; ``fsync`` makes each write durable before it is acknowledged."""

    name = "file"

    def __init__(self, namespace: str, page_nbytes: int, root: str, fsync: bool = False) -> None:
        super().__init__(namespace, page_nbytes)
        self.root = os.path.abspath(root)
        self.fsync = fsync
        self.directory = os.path.join(self.root, self.namespace_tag)
        os.makedirs(self.directory, exist_ok=True)

    def path(self, key: str) -> str:
        """The file of ``key``; ValueError if the key is not a page hash or the path leaves the store."""
        check_key(key)
        path = os.path.normpath(os.path.join(self.directory, key[:2], key[2:4], key + PAGE_SUFFIX))
        if os.path.commonpath([path, self.directory]) != self.directory:
            raise ValueError(f"page key {key!r} maps outside the store directory {self.directory}")
        return path

    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        paths = [self.path(k) for k in keys]
        for i, path in enumerate(paths):
            try:
                if os.stat(path).st_size != self.format.blob_nbytes:
                    return i
            except FileNotFoundError:
                return i
            except OSError as err:
                self._error(f"stat {path}", err)
                return i
        return len(paths)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, targets)
        paths = [self.path(k) for k in keys]
        with self._timed("get"):
            return [self._get_one(key, path, view) for key, path, view in zip(keys, paths, views)]

    def _get_one(self, key: str, path: str, view: memoryview) -> bool:
        header = bytearray(HEADER_SIZE)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError as err:
            self._error(f"open {path}", err)
            return False
        read, payload_checksum = 0, None
        try:
            size = os.fstat(fd).st_size
            if size == self.format.blob_nbytes and os.preadv(fd, [header], self.page_nbytes) == HEADER_SIZE:
                read, payload_checksum = read_with_checksum(fd, view, 0)
        except OSError as err:
            self._error(f"read {path}", err)
            return False
        finally:
            os.close(fd)
        # A short or oversized file fails verify on its length (the header then names the expected one).
        if not self._verified(key, header, view[:read], payload_checksum if read == len(view) else None):
            return False
        self._count(get_pages=1, get_bytes=self.page_nbytes)
        return True

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, values)
        paths = [self.path(k) for k in keys]
        done = []
        with self._timed("set"):
            for key, path, view in zip(keys, paths, views):
                done.append(self._set_one(key, path, view))
            if self.fsync:
                self._sync_dirs({os.path.dirname(p) for p, ok in zip(paths, done) if ok})
        return done

    def _set_one(self, key: str, path: str, view: memoryview) -> bool:
        temp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # The checksum comes from the same cache-hot pass as the write.
                payload_checksum = write_with_checksum(fd, view, 0)
                _write_all(fd, memoryview(self.format.header(key, view, payload_checksum)), self.page_nbytes)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError as err:
            self._error(f"write {path}" + (" (disk full)" if err.errno == errno.ENOSPC else ""), err)
            try:
                os.unlink(temp)
            except OSError:
                pass
            return False
        self._count(set_pages=1, set_bytes=self.page_nbytes)
        return True

    def _sync_dirs(self, directories: set[str]) -> None:
        # The rename is durable only once its directory entry is.
        for directory in directories:
            try:
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as err:
                self._error(f"fsync {directory}", err)

    def _drop(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as err:
            self._error(f"remove corrupt page {key}", err)

    def clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        os.makedirs(self.directory, exist_ok=True)
