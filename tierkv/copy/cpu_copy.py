"""CPU <-> CPU page copies for the ``kernel`` io backend.

With the native module (tierkv/copy/_rowcopy.c, built at install when a C compiler is there) a batch is
one call: the pools' per-layout chunk offsets of page 0 plus the page ids, copied chunk by chunk in
the destination's memory order without the GIL, adjacent chunks merged. :class:`ChunkCopy` works the
offsets out once per pair of pools and takes token slots straight from the allocator, checked in C.
Without it, token rows move with vectorised torch/numpy index ops (:func:`copy_rows`). Both must move
exactly the same bytes; the test suite runs against each.
"""

from __future__ import annotations

import logging
import threading
from functools import cached_property
from types import ModuleType

import numpy as np
import torch

from tierkv.pools.kv import PagedKVBuffer, rows_adjacent_per_page
from tierkv.pools.page_digests import PageDigests

log = logging.getLogger(__name__)

NATIVE_API_VERSION = 5  # the API_VERSION of tierkv/copy/_rowcopy.c that this module calls


def usable_native(module: ModuleType | None) -> ModuleType | None:
    """``module`` when it is a build of the _rowcopy.c this module calls, else None (the torch fallback):
    an older build found on the path (say, left by an editable install of another checkout) takes other
    arguments."""
    if module is None or getattr(module, "API_VERSION", 1) == NATIVE_API_VERSION:
        return module
    log.warning("ignoring %s: API version %s, expected %s (rebuild: python setup.py build_ext --inplace)",
                getattr(module, "__file__", module), getattr(module, "API_VERSION", 1), NATIVE_API_VERSION)
    return None


try:
    from tierkv.copy import _rowcopy  # type: ignore[attr-defined]
except ImportError:  # no compiler at install time: the torch fallback is used
    _rowcopy = None
native: ModuleType | None = usable_native(_rowcopy)


def native_available() -> bool:
    return native is not None


def native_hashing() -> bool:
    """Whether the native copy can hash the pages it writes: both native modules built, the copy given the
    page I/O's xxh3 (bound there from the xxhash package and checked against it) on first ask."""
    global _hash_bound
    if _hash_bound is None:
        from tierkv.storage.native import pageio  # a leaf module: xxhash and the built _pageio only
        _hash_bound = native is not None and pageio is not None and hasattr(pageio, "xxh3_functions")
        if _hash_bound:
            native.use_xxh3(pageio.xxh3_functions)
    return _hash_bound


_hash_bound: bool | None = None


def copy_page_chunks(src: PagedKVBuffer, src_pages: torch.Tensor, dst: PagedKVBuffer,
                     dst_pages: torch.Tensor, layer: int | None = None) -> None:
    """Copy whole pages between two CPU pools with the native module, one call per batch (``layer``:
    only that layer's part of them, for a layer-wise load)."""
    ChunkCopy(src, dst, layer)(src_pages, dst_pages)


class ChunkCopy:
    """The native copy between two CPU pools (``layer``: that layer's part of each page only), its
    layout-dependent arguments worked out once: a transfer controller copies between the same two pools
    all its life, and at a few pages per copy that work costs as much as the copy's own call.

    ``digests``: the destination's digest table, which a slot copy asked to hash fills as it writes each
    page (see :mod:`tierkv.pools.page_digests`)."""

    def __init__(self, src: PagedKVBuffer, dst: PagedKVBuffer, layer: int | None = None, name: str = "copy",
                 digests: PageDigests | None = None) -> None:
        if native is None:
            raise RuntimeError("tierkv.copy._rowcopy is not built; use copy_rows")
        # a page's token rows are adjacent on both sides: one chunk per page and (kv, layer)
        whole_pages = rows_adjacent_per_page(src, dst)
        order = dst.row_dim_order
        if order != src.row_dim_order:
            # the layouts nest pages differently (page-first vs layer-first): go page by page, so that each
            # side's working set is one page's scattered pieces (in cache), in the memory order of the side
            # that keeps a page together, read or written front to back (a load from a page-first host
            # pool walked in the L1 pool's order took 2-4% longer)
            if src.row_dim_order[0] == 2:
                order = src.row_dim_order
            order = (2, *(d for d in order if d != 2))
        src_base, inner = src.chunk_bases(whole_pages, order, layer)
        dst_base, _ = dst.chunk_bases(whole_pages, order, layer)
        chunk_nbytes = src.rows.shape[1] * (src.page_size if whole_pages else 1)
        self._buffers = (dst.rows_np, src.rows_np, dst_base, src_base)
        self._sizes = (dst.page_stride_nbytes, src.page_stride_nbytes, inner, chunk_nbytes)
        self._slot_rule = (src.page_size, dst.allocator.num_pages, src.allocator.num_pages, name)
        self._digests = digests if layer is None else None

    @cached_property
    def _slots(self) -> "native.SlotCopier":
        """The slot path's arguments held in C: a copy's call then parses its two slot arrays only (built
        on first use: a layer-wise load makes a ChunkCopy per layer and never copies slots)."""
        table = {} if self._digests is None else {"digests": self._digests.values, "digest_valid": self._digests.valid}
        return native.SlotCopier(*self._buffers, *self._sizes, *self._slot_rule, **table)

    @cached_property
    def hashes_pages(self) -> bool:
        """Whether :meth:`copy_slots` can hash: a digest table, xxh3 bound, and each destination page written
        whole and in address order (page-first destinations)."""
        return self._digests is not None and native_hashing() and self._slots.hashes_pages()

    def __call__(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        native.copy_pages(*self._buffers, _int64_array(dst_pages), _int64_array(src_pages), *self._sizes)

    def copy_slots(self, src_slots: torch.Tensor | np.ndarray, dst_slots: torch.Tensor | np.ndarray,
                   check_only: bool = False, hash_pages: bool = False) -> None:
        """Copy the whole pages of these token slots (equally many on both sides), checked as the slot
        allocator checks them: a ValueError names the first problem and nothing is copied. One native
        call, no tensor op (the path of small copies). ``check_only``: check, copy nothing. ``hash_pages``
        (only where :attr:`hashes_pages`): record each destination page's digest as it is written."""
        try:  # the common case, CPU int64 tensors or arrays, goes to C as it is
            self._slots.copy_slots(src_slots, dst_slots, check_only, hash_pages)
        except (TypeError, BufferError, RuntimeError):  # another dtype or device, strided, or autograd
            self._slots.copy_slots(_int64_array(src_slots), _int64_array(dst_slots), check_only, hash_pages)


def _int64_array(pages: torch.Tensor | np.ndarray) -> np.ndarray:
    """The pages as a contiguous int64 numpy array, without a copy in the common case (the allocator
    hands out CPU int64 tensors). Per small copy this runs twice, so the common case asks nothing first."""
    if isinstance(pages, np.ndarray):
        array = pages
    else:
        try:
            array = pages.numpy()
        except (TypeError, RuntimeError):  # on an accelerator, or part of an autograd graph
            array = pages.detach().cpu().numpy()
    if array.dtype == np.int64 and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=np.int64)


_MIN_SEGMENT_ROWS = 8
_staging = threading.local()


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, src_order: tuple[int, ...], dst: torch.Tensor,
              dst_rows: torch.Tensor, dst_order: tuple[int, ...]) -> None:
    """Copy byte rows ``src[src_rows[i]] -> dst[dst_rows[i]]`` in as few passes over memory as possible.

    ``*_rows`` are shaped ``[kv, layers, pages, rows-per-page]``; ``*_order`` lists those dims in each
    side's memory order.

    When the destination rows, taken in the destination's memory order, fall into long contiguous
    segments, each segment is one ``index_select`` straight into it; else when the source rows do, one
    ``index_copy_`` out of each; only when both sides are fragmented do rows go through a staging
    buffer (reused, so its memory is not faulted in again on every copy).
    """
    for into_dst, order in ((True, dst_order), (False, src_order)):
        s_rows, d_rows = src_rows.permute(order).reshape(-1), dst_rows.permute(order).reshape(-1)
        segments = page_segments(d_rows if into_dst else s_rows)
        if segments is None:
            continue
        for a, b, first in segments:
            if into_dst:
                torch.index_select(src, 0, s_rows[a:b], out=dst.narrow(0, first, b - a))
            else:
                _scatter_rows(dst, d_rows[a:b], src.narrow(0, first, b - a))
        return
    s_rows, d_rows = src_rows.reshape(-1), dst_rows.reshape(-1)
    staging = _staging_rows(len(s_rows), src)
    torch.index_select(src, 0, s_rows, out=staging)
    _scatter_rows(dst, d_rows, staging)


def page_segments(rows: torch.Tensor, min_rows: int = _MIN_SEGMENT_ROWS) -> list[tuple[int, int, int]] | None:
    """``(start, end, first_row)`` of the runs of consecutive ``rows``; None when they average fewer
    than ``min_rows`` rows."""
    n = len(rows)
    if n == 0:
        return []
    first = int(rows[0])
    if int(rows[-1]) - first == n - 1 and torch.equal(rows, torch.arange(first, first + n)):
        return [(0, n, first)]  # the common case of one destination run in a page-first layout
    breaks = torch.nonzero(rows[1:] - rows[:-1] != 1).flatten().add_(1).tolist()
    if n < min_rows * (len(breaks) + 1):
        return None
    bounds = [0, *breaks, n]
    return list(zip(bounds, bounds[1:], rows[bounds[:-1]].tolist()))


def _scatter_rows(rows: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``rows[index] = values`` for CPU byte rows. numpy's fancy assignment moves each row with one
    memmove (in 8-byte words when rows allow); torch's index_copy_ goes element by element, ~5x slower."""
    word = np.int64 if rows.shape[1] % 8 == 0 else np.uint8
    rows.numpy().view(word)[index.numpy()] = values.numpy().view(word)


def _staging_rows(num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """A per-thread scratch of ``num_rows`` rows shaped like ``like``'s, grown (and touched) on demand."""
    buf = getattr(_staging, "buf", None)
    need = num_rows * like.shape[1]
    if buf is None or buf.dtype != like.dtype or buf.numel() < need:
        buf = torch.zeros(max(need, 1 << 16), dtype=like.dtype)
        _staging.buf = buf
    return buf[:need].view(num_rows, like.shape[1])
