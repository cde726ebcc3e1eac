"""Reading pages out of packs (the file store's read path; the format is in file_pack).

Targets come as one byte view a page (``list[memoryview]``), or, for a prefetch into the host pool's
page rows, as :class:`PageRows`: the rows and the row of each page, a view made only for a run of
consecutive rows. A replay's prefetches read 170,000 pages of 256 bytes in 314 calls; a view a page,
made before the read, cost as much as the reads themselves (~0.2 CPU-s). Either way the bytes read are
the same.

The pages a batch wants of each pack are numpy arrays (their slots, sorted, and their places in the
batch), grouped by pack in one sort: a Python tuple a page cost ~1 us a page more.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tierkv.storage.file_pack import SLOT_BITS, SLOT_MASK, read_run, slot_groups
from tierkv.storage.file_write import RowRuns, page_checksums

Wanted = tuple[np.ndarray, np.ndarray]  # a pack's wanted slots (sorted) and the batch index of each


class PageRows:
    """Pages ``index[i]`` of ``rows`` (a C-contiguous 2-D uint8 array, a page a row, already checked):
    ``self[i]`` is a view of page i's row; :meth:`pieces` the views of several pages with consecutive
    rows merged."""

    def __init__(self, rows: np.ndarray, index: np.ndarray) -> None:
        self.rows, self.flat = rows, memoryview(rows).cast("B")
        self.index = np.asarray(index, dtype=np.int64)
        self.page_nbytes = rows.shape[1]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> memoryview:
        row, nbytes = int(self.index[i]), self.page_nbytes
        return self.flat[row * nbytes:(row + 1) * nbytes]

    def pieces(self, batch: np.ndarray) -> list[memoryview]:
        """Views of pages ``batch`` (batch indices) back to back, one a run of consecutive rows."""
        nbytes = self.page_nbytes
        return [self.flat[first * nbytes:(first + count) * nbytes]
                for first, count in RowRuns(self.rows, self.index[batch]).runs()]


class Picked:
    """``views[batch[i]]`` for the i given, made on demand (only a page that fails its check is looked at)."""

    def __init__(self, views: Sequence[memoryview], batch: list[int]) -> None:
        self.views, self.batch = views, batch

    def __len__(self) -> int:
        return len(self.batch)

    def __getitem__(self, i: int) -> memoryview:
        return self.views[self.batch[i]]


def wanted_by_pack(places: list[int | None]) -> dict[int, Wanted]:
    """The index ``places`` (None: not stored) grouped by pack: for each pack, its slots wanted (sorted;
    a slot wanted twice, twice) and their batch indexes, in one stable sort (a place is pack << SLOT_BITS
    | slot, so sorting places sorts by pack, then slot)."""
    if None in places:
        batch = np.array([i for i, place in enumerate(places) if place is not None], dtype=np.int64)
        stored = np.array([places[i] for i in batch.tolist()], dtype=np.int64)
    else:
        batch = np.arange(len(places), dtype=np.int64)
        stored = np.array(places, dtype=np.int64)
    if not len(stored):
        return {}
    order = np.argsort(stored, kind="stable")
    stored, batch = stored[order], batch[order]
    numbers = stored >> SLOT_BITS
    cuts = [0, *(np.flatnonzero(np.diff(numbers)) + 1).tolist(), len(stored)]
    slots = stored & SLOT_MASK
    return {int(numbers[start]): (slots[start:end], batch[start:end]) for start, end in zip(cuts, cuts[1:])}


def read_payloads(fd: int, wanted: Wanted, views: list[memoryview] | PageRows, page_nbytes: int,
                  group_nbytes: int, hashed: bool, native: object | None,
                  read_large: Callable[[int, memoryview, int], int | None]) -> list[int] | None:
    """Read the ``wanted`` pages of the pack open at ``fd``, each group of consecutive slots in one call,
    and checksum each group right after it lands, while it is in cache (a page over ``group_nbytes``:
    ``read_large``); the checksums in ``wanted`` order (none unless ``hashed``), or None if the pack was
    short."""
    slots, batch = wanted
    digests: list[int] = []
    rows = isinstance(views, PageRows)
    for start, end in slot_groups(slots, page_nbytes, group_nbytes):
        offset = int(slots[start]) * page_nbytes
        if end - start == 1 and page_nbytes > group_nbytes:
            digest = read_large(fd, views[int(batch[start])], offset)
            if digest is None:
                return None
            digests.append(digest)
            continue
        pieces = views.pieces(batch[start:end]) if rows else [views[i] for i in batch[start:end].tolist()]
        if read_run(fd, pieces, offset) != (end - start) * page_nbytes:
            return None
        if hashed:
            digests += page_checksums(pieces, page_nbytes, native)
    return digests
