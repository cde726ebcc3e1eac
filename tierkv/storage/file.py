"""Page store on a local directory: one file per page, written atomically, readable after a restart.

Layout: ``<root>/<namespace tag>/<key[0:2]>/<key[2:4]>/<key>.page``, each file the 48-byte header then
the payload. Writes go to a per-thread temp file beside the target and are renamed over it, so a
reader sees a whole old page, a whole new page or none. Reads land straight in the caller's page
tensor (``preadv``), writes go straight from it (``writev``): no staging copy on either side.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading

import torch

from tierkv.storage.base import PageStore, check_key
from tierkv.storage.page_format import HEADER_SIZE

PAGE_SUFFIX = ".page"


def _write_all(fd: int, parts: list[memoryview]) -> None:
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= len(parts[0]):
            written -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][written:]


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
        try:
            size = os.fstat(fd).st_size
            read = os.preadv(fd, [header, view], 0) if size == self.format.blob_nbytes else 0
        except OSError as err:
            self._error(f"read {path}", err)
            return False
        finally:
            os.close(fd)
        if read != self.format.blob_nbytes:
            # A short or oversized file: let verify name it (header length vs payload length).
            return self._verified(key, header, view[:max(0, read - HEADER_SIZE)])
        if not self._verified(key, header, view):
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
                _write_all(fd, [memoryview(self.format.header(key, view)), view])
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
