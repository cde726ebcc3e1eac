"""The bound of a file store's directory as a whole, shared by every process writing into it.

Each :class:`tierkv.storage.file.FileStore` keeps its own LRU index, which bounds only what that
process knows of. Several processes sharing one bounded directory would each fill it to the bound, so
the directory also carries a ledger: ``.usage`` holds the bytes of pack files written into it (8
bytes, little-endian), updated under an ``fcntl`` lock on that file by every process after each batch
it writes (one pack per batch, see :mod:`tierkv.storage.file_pack`). When a batch takes the ledger
over ``max_bytes``, that process scans the directory (one stat per pack), removes the least recently
used packs (oldest modification time; a hit refreshes it) down to the low-water mark, and writes the
exact total back.

The ledger never counts less than the packs it was told of (a pack another process's own LRU removed
only makes it count more, which costs an earlier scan), so the packs on disk exceed ``max_bytes`` by
at most the batches written but not yet charged: one batch per writing thread, in every process, at
any moment. A process that dies between the two leaves its last
batch uncounted until the next scan.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

LEDGER_NAME = ".usage"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# After a scan the directory is cut to this share of max_bytes, so that the next scan is at least
# max_bytes // LOW_WATER_DIVISOR of writes away (a scan stats every page).
LOW_WATER_DIVISOR = 16


class DirectoryBudget:
    """The shared ledger of one namespace directory (see the module docstring)."""

    def __init__(self, directory: str, max_bytes: int, page_suffix: str) -> None:
        """``page_suffix``: the ending of the names of the files it counts (the store's packs)."""
        self.directory, self.max_bytes, self.page_suffix = directory, max_bytes, page_suffix
        self.low_water_bytes = max_bytes - max_bytes // LOW_WATER_DIVISOR
        self.path = os.path.join(directory, LEDGER_NAME)
        self.scans = 0
        with self._locked() as fd:
            if os.fstat(fd).st_size < 8:  # a new ledger (or a directory of an earlier version): count it
                self._write(fd, self._scan_and_cut(self.max_bytes)[0])

    @contextmanager
    def _locked(self) -> Iterator[int]:
        # one open file description per use: flock then also excludes this process's other threads
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    @staticmethod
    def _read(fd: int) -> int:
        return int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")

    @staticmethod
    def _write(fd: int, num_bytes: int) -> None:
        os.pwrite(fd, max(0, num_bytes).to_bytes(8, "little"), 0)

    def charge(self, num_bytes: int) -> int:
        """Count ``num_bytes`` of pages just written (negative: just removed by their writer's own LRU);
        cut the directory if that passes the bound. The number of pages the cut removed."""
        if not num_bytes:
            return 0
        with self._locked() as fd:
            used = self._read(fd) + num_bytes
            removed = 0
            if num_bytes > 0 and used > self.max_bytes:
                used, removed = self._scan_and_cut(self.low_water_bytes)
            self._write(fd, used)
        return removed

    def reset(self) -> None:
        """The directory was emptied (``clear``): count from zero."""
        with self._locked() as fd:
            self._write(fd, 0)

    def _scan_and_cut(self, target_bytes: int) -> tuple[int, int]:
        """Total the pack files in the directory and remove the least recently used down to
        ``target_bytes``; the total left and the number of files removed. Caller holds the lock."""
        self.scans += 1
        top = os.open(self.directory, _DIR_FLAGS)
        try:
            return self._cut(self._pages(top), target_bytes)
        finally:
            os.close(top)

    def _pages(self, sub_fd: int) -> list[tuple[int, int, int, str]]:
        found = []
        with os.scandir(sub_fd) as entries:
            for entry in entries:
                if not entry.name.endswith(self.page_suffix):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found.append((info.st_mtime_ns, info.st_size, sub_fd, entry.name))
        return found

    @staticmethod
    def _cut(pages: list[tuple[int, int, int, str]], target_bytes: int) -> tuple[int, int]:
        total, removed = sum(page[1] for page in pages), 0
        for _, size, sub_fd, name in sorted(pages):
            if total <= target_bytes:
                break
            try:
                os.unlink(name, dir_fd=sub_fd)
            except FileNotFoundError:
                pass
            total -= size
            removed += 1
        return total, removed
