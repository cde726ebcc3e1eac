"""Writing a pack's payloads and headers (the file store's write path; the format is in file_pack).

Payloads come as one byte view a page (``list[memoryview]``), or, for a backup from the host pool's page
rows, as :class:`RowRuns`: the rows in runs of consecutive pages, one view a run. A replay's backups
wrote 1.2 million pages in 6,710 runs; a view a page cost ~1 CPU-s there, much of it in the garbage
collector (a memoryview is a tracked object). Either way the pack's bytes are the same.

Both write a batch within ``group_nbytes`` in one ``pwritev`` with its headers and key list, checksums
made first (one native call); a larger one group by group, each checksummed right before it is written,
while it is in cache, then the headers and the key list.
"""

from __future__ import annotations

import os

import numpy as np
import xxhash

from tierkv.storage.file_pack import IOV_MAX, consumed, run_bounds, slot_groups
from tierkv.storage.page_format import CHUNK_NBYTES, PageFormat



def write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write ``buffers`` back to back from ``offset``: one ``pwritev`` per 1,024 buffers unless the kernel
    takes less."""
    while buffers:
        written = os.pwritev(fd, buffers[:IOV_MAX], offset)
        offset += written
        buffers = consumed(buffers, written)


class RowRuns:
    """Pages ``index[i]`` of ``rows`` (a C-contiguous 2-D uint8 array, a page a row, already checked) in
    that order, as runs of consecutive rows."""

    def __init__(self, rows: np.ndarray, index: np.ndarray) -> None:
        self.rows, self.index = rows, np.asarray(index, dtype=np.int64)
        self.page_nbytes = rows.shape[1]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, part: slice) -> "RowRuns":
        return RowRuns(self.rows, self.index[part])

    def runs(self) -> list[tuple[int, int]]:
        """(first row, pages) of each run of consecutive rows, in order."""
        if not len(self.index):
            return []
        bounds = run_bounds(self.index)
        firsts = self.index[bounds[:-1]].tolist()
        return [(first, end - start) for first, start, end in zip(firsts, bounds, bounds[1:])]

    def groups(self, group_nbytes: int) -> list[list[memoryview]]:
        """The runs cut into groups of at most ``group_nbytes`` (at least a page each), each a list of
        views of consecutive rows."""
        flat, nbytes = memoryview(self.rows).cast("B"), self.page_nbytes
        per_group = max(1, group_nbytes // nbytes)
        groups: list[list[memoryview]] = []
        group: list[memoryview] = []
        room = per_group
        for row, left in self.runs():
            while left:
                take = min(left, room)
                group.append(flat[row * nbytes:(row + take) * nbytes])
                row, left, room = row + take, left - take, room - take
                if not room:
                    groups.append(group)
                    group, room = [], per_group
        return groups + ([group] if group else [])


def page_checksums(pieces: list[memoryview], page_nbytes: int, native: object | None) -> list[int]:
    """xxh3-64 of each page of ``pieces`` (views of whole pages), in one native call where built."""
    if native is not None:
        return native.xxh3_pages(pieces, page_nbytes)
    return [xxhash.xxh3_64_intdigest(piece[at:at + page_nbytes])
            for piece in pieces for at in range(0, len(piece), page_nbytes)]


def write_row_runs(fd: int, fmt: PageFormat, keys: list[str], runs: RowRuns, trailer: memoryview,
                   group_nbytes: int, native: object | None) -> None:
    """Write an unkeyed pack from ``runs`` (pages of at most ``group_nbytes``), group by group."""
    nbytes = runs.page_nbytes
    groups = runs.groups(group_nbytes)
    if len(groups) <= 1:
        pieces = groups[0] if groups else []
        headers = fmt.filled_headers(keys, page_checksums(pieces, nbytes, native))
        write_all(fd, [*pieces, memoryview(headers).cast("B"), trailer], 0)
        return
    digests: list[int] = []
    offset = 0
    for pieces in groups:
        digests += page_checksums(pieces, nbytes, native)
        write_all(fd, pieces, offset)
        offset += sum(map(len, pieces))
    headers = fmt.filled_headers(keys, digests)
    write_all(fd, [memoryview(headers).cast("B"), trailer], offset)


def write_views(fd: int, fmt: PageFormat, keys: list[str], views: list[memoryview], trailer: memoryview,
                group_nbytes: int, native: object | None) -> None:
    """Write a pack from a view a page; a keyed store's MACs are made page by page first."""
    nbytes = fmt.payload_nbytes
    if fmt.keyed:
        headers = b"".join(fmt.header(k, v) for k, v in zip(keys, views))
        write_all(fd, [*views, memoryview(headers), trailer], 0)
        return
    if len(views) * nbytes <= group_nbytes:
        headers = fmt.filled_headers(keys, page_checksums(views, nbytes, native))
        write_all(fd, [*views, memoryview(headers).cast("B"), trailer], 0)
        return
    digests: list[int] = []
    for start, end in slot_groups(np.arange(len(views)), nbytes, group_nbytes):
        if end - start == 1 and nbytes > group_nbytes:  # a page over a group: chunk by chunk
            state = xxhash.xxh3_64()
            for at in range(0, nbytes, CHUNK_NBYTES):
                chunk = views[start][at:at + CHUNK_NBYTES]
                state.update(chunk)
                write_all(fd, [chunk], start * nbytes + at)
            digests.append(state.intdigest())
            continue
        digests += page_checksums(views[start:end], nbytes, native)
        write_all(fd, views[start:end], start * nbytes)
    headers = fmt.filled_headers(keys, digests)
    write_all(fd, [memoryview(headers).cast("B"), trailer], len(views) * nbytes)
