"""KV pools: one tensor per tier indexed by token slot, with a page-granular allocator.

Every pool exposes its buffer through a *paged view*: a tensor with one dimension indexing pages and a
permutation that turns a selection of pages into the canonical ``[num_kv, layers, pages, page_size,
heads, dim]`` order. Transfers only ever talk in that canonical order, so any two layouts copy into
each other without knowing each other's shapes.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tierkv.pools.allocator import SlotAllocator
from tierkv.pools.huge_pages import advise_huge_pages
from tierkv.pools.page_digests import PageDigests
from tierkv.pools.spec import KVSpec

log = logging.getLogger(__name__)

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


class PagedKVBuffer:
    """A KV buffer plus its allocator. Subclasses fix the layout by setting ``paged``/``page_dim``/``perm``."""

    layout = "layer_first"

    def __init__(self, spec: KVSpec, num_tokens: int, page_size: int, device: torch.device | str,
                 pin_memory: bool = False) -> None:
        if not isinstance(num_tokens, int) or num_tokens < page_size:
            raise ValueError(f"pool size {num_tokens!r} tokens is smaller than one page of {page_size}")
        self.spec = spec
        self.page_size = page_size
        self.allocator = SlotAllocator(num_tokens, page_size)
        self.num_slots = self.allocator.num_slots
        self.num_pages = self.allocator.num_pages
        self.device = torch.device(device)
        self.buffer = torch.empty(self._shape(), dtype=spec.dtype, device=self.device, pin_memory=pin_memory)
        advise_huge_pages(self.buffer)  # before the first touch: scattered page-1 copies miss the TLB less
        self.buffer.zero_()  # touch every page now: first writes to fresh memory are far slower
        self.paged, self.page_dim, self.perm = self._paged_view()
        self.inverse_perm = _inverse(self.perm)
        self.rows, self.row_strides, self.row_dim_order = self._row_table()

    # layer_first by default: [num_kv, layers, slots, heads, dim]
    def _shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_kv, s.num_layers, self.num_slots, s.heads, s.dim)

    def _paged_view(self) -> tuple[torch.Tensor, int, tuple[int, ...]]:
        return self.buffer.unflatten(2, (self.num_pages, self.page_size)), 2, (0, 1, 2, 3, 4, 5)

    def _row_table(self) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
        """The buffer as uint8 rows of one token's ``[heads, dim]`` for one K/V and layer (contiguous in
        every layout; torch gathers byte rows with memcpy); the row strides of the canonical ``(kv, layer,
        page, token-in-page)`` dims; those dims in memory order."""
        canonical = self.paged.permute(self.perm)
        row_elems = self.spec.heads * self.spec.dim
        if canonical.stride(5) != 1 or canonical.stride(4) != self.spec.dim:
            raise AssertionError(f"layout {self.layout}: [heads, dim] is not contiguous")
        strides = tuple(canonical.stride(i) // row_elems for i in range(4))
        rows = self.buffer.view(-1, row_elems).view(torch.uint8)
        order = tuple(sorted(range(4), key=lambda i: -strides[i]))
        sk, sl, _, so = strides
        s = self.spec
        self._row_base = (torch.arange(s.num_kv).mul_(sk).view(-1, 1, 1, 1)
                          + torch.arange(s.num_layers).mul_(sl).view(1, -1, 1, 1)
                          + torch.arange(self.page_size).mul_(so).view(1, 1, 1, -1))
        # the native CPU copy reads buffers through numpy; accelerator pools have no such view
        self.rows_np = rows.numpy() if rows.device.type == "cpu" else None
        self._chunk_bases: dict[tuple[bool, tuple[int, ...]], tuple[np.ndarray, int]] = {}
        return rows, strides, order

    @property
    def page_stride_nbytes(self) -> int:
        """Bytes between the same row of two consecutive pages in :attr:`rows`."""
        return self.row_strides[2] * self.rows.shape[1]

    def chunk_bases(self, whole_pages: bool, order: tuple[int, ...], layer: int | None = None
                    ) -> tuple[np.ndarray, int]:
        """Byte offsets in :attr:`rows` of page 0's chunks, flat in ``order`` of the canonical ``(kv, layer,
        page, token-in-page)`` dims with the page dim left out, and how many follow the page dim there.

        A chunk is a token row, or with ``whole_pages`` all of a page's rows for one (kv, layer), valid
        only when they are adjacent (``row_strides[3] == 1``). ``layer``: that layer's chunks only (a
        layer-wise load). Cached: a pool sees few orders."""
        key = (whole_pages, order, layer)
        if key not in self._chunk_bases:
            base = self._row_base[..., :1] if whole_pages else self._row_base
            if layer is not None:
                base = base[:, layer:layer + 1]
            base = base.permute(order).numpy() * self.rows.shape[1]
            page_pos = order.index(2)
            inner = int(np.prod(base.shape[page_pos + 1:]))
            self._chunk_bases[key] = (np.ascontiguousarray(base, dtype=np.int64).reshape(-1), inner)
        return self._chunk_bases[key]

    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Row indices of the given pages, shaped ``[num_kv, layers, len(pages), page_size]``."""
        return self._row_base + (pages.to(torch.int64) * self.row_strides[2]).view(1, 1, -1, 1)

    @property
    def size_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def page_nbytes(self) -> int:
        return self.page_size * self.spec.bytes_per_token

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free_slots

    def gather_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Copy of the selected pages in canonical order (a permuted view of a fresh tensor)."""
        return self.paged.index_select(self.page_dim, pages.to(self.device)).permute(self.perm)

    def scatter_pages(self, pages: torch.Tensor, canonical: torch.Tensor) -> None:
        """Write canonical-order data into the selected pages."""
        src = canonical.permute(self.inverse_perm)
        self.paged.index_copy_(self.page_dim, pages.to(self.device), src)

    def page_range(self, first_page: int, num_pages: int) -> torch.Tensor:
        """A canonical-order view of ``num_pages`` consecutive pages (no copy)."""
        return self.paged.narrow(self.page_dim, first_page, num_pages).permute(self.perm)

    def read_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """KV of the given slots as ``[num_kv, layers, n, heads, dim]`` (a copy). For tests and tools."""
        pages = self.allocator.slots_to_pages(slots) if len(slots) % self.page_size == 0 else None
        if pages is not None:
            return self.gather_pages(pages).flatten(2, 3).contiguous()
        raise ValueError("read_tokens needs whole pages")

    def write_tokens(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``[num_kv, layers, n, heads, dim]`` into whole pages of slots. For tests and tools."""
        pages = self.allocator.slots_to_pages(slots)
        self.scatter_pages(pages, kv.unflatten(2, (len(pages), self.page_size)))


def rows_adjacent_per_page(a: PagedKVBuffer, b: PagedKVBuffer) -> bool:
    """True when, in both pools, each page's token rows for one (kv, layer) are adjacent, so a page
    can move as one wide row (and page_size > 1, where that is worth anything)."""
    return a.page_size > 1 and a.row_strides[3] == 1 and b.row_strides[3] == 1


def paired_page_rows(a: PagedKVBuffer, a_pages: torch.Tensor, b: PagedKVBuffer, b_pages: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_table, a_rows, b_table, b_rows)``: each pool's byte-row table and the row indices of the
    given pages (``[num_kv, layers, pages, k]``), widened to one row per page when
    :func:`rows_adjacent_per_page`."""
    a_rows, b_rows = a.page_rows(a_pages), b.page_rows(b_pages)
    if not rows_adjacent_per_page(a, b):
        return a.rows, a_rows, b.rows, b_rows
    ps = a.page_size
    return (a.rows.view(-1, ps * a.rows.shape[1]), a_rows[..., :1] // ps,
            b.rows.view(-1, ps * b.rows.shape[1]), b_rows[..., :1] // ps)


class DeviceKVPool(PagedKVBuffer):
    """L1: the accelerator pool attention reads. Layer-first so each layer's K/V is one tensor."""

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        if self.spec.attention != "mha":
            raise ValueError("an MLA pool has one latent buffer per layer; use latent_buffer()")
        return self.buffer[1, layer]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        return self.buffer[0, layer]


class HostKVPool(PagedKVBuffer):
    """L2: host memory, pinned when CUDA exists, in one of three layouts (see module docstring)."""

    def __init__(self, spec: KVSpec, num_tokens: int, page_size: int, layout: str = "layer_first",
                 pin_memory: bool | None = None) -> None:
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"host layout {layout!r} is not one of {HOST_LAYOUTS}")
        self.layout = layout
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(spec, num_tokens, page_size, "cpu", pin_memory=pin_memory)
        # Page-first layouts keep each page contiguous: one uint8 row per page, made once, so that a page's
        # bytes are one index (~1 us) instead of a select, a reshape and a view (~4 us) per page.
        self._page_rows = (None if layout == "layer_first"
                           else self.buffer.view(self.num_pages, -1).view(torch.uint8))
        # each page's checksum as the hashed L1 -> L2 copy wrote it, for L3 backups (page-contiguous layouts:
        # a digest is of one page's bytes as stored); off until an L3 store that takes digests enables it
        self.digests = None if self._page_rows is None else PageDigests(self.num_pages, page_size)

    def _shape(self) -> tuple[int, ...]:
        s = self.spec
        if self.layout == "page_first":
            return (self.num_slots, s.num_kv, s.num_layers, s.heads, s.dim)
        if self.layout == "page_first_direct":
            return (self.num_pages, s.num_kv, s.num_layers, self.page_size, s.heads, s.dim)
        return super()._shape()

    def _paged_view(self) -> tuple[torch.Tensor, int, tuple[int, ...]]:
        if self.layout == "page_first":
            return self.buffer.unflatten(0, (self.num_pages, self.page_size)), 0, (2, 3, 0, 1, 4, 5)
        if self.layout == "page_first_direct":
            return self.buffer, 0, (1, 2, 0, 3, 4, 5)
        return super()._paged_view()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots of whole free pages, their digests cleared: what is written there next is new bytes."""
        slots = self.allocator.alloc(num_tokens)
        if slots is not None and self.digests is not None:
            self.digests.forget_slots(slots)
        return slots

    def scatter_pages(self, pages: torch.Tensor, canonical: torch.Tensor) -> None:
        if self.digests is not None:
            self.digests.forget_pages(pages)
        super().scatter_pages(pages, canonical)

    def page_bytes(self, page: int) -> torch.Tensor | None:
        """A writable uint8 view of one page's bytes when the layout keeps a page contiguous, else None."""
        return None if self._page_rows is None else self._page_rows[page]

    def page_bytes_array(self) -> np.ndarray | None:
        """The whole pool as a writable (num_pages, page_nbytes) uint8 array, row ``p`` page ``p``'s bytes
        (the page stores' batch_set_rows / batch_get_rows take it); None when the layout splits a page.
        Written only into pages just allocated (:meth:`alloc` cleared their digests), else clear them."""
        return None if self._page_rows is None else self._page_rows.numpy()

    def read_page(self, page: int) -> torch.Tensor:
        """One page as contiguous uint8 bytes (a view for page-first layouts, a copy for layer_first)."""
        view = self.page_bytes(page)
        if view is not None:
            return view
        return self.paged.select(self.page_dim, page).contiguous().reshape(-1).view(torch.uint8)

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Fill one page from uint8 bytes as produced by :meth:`read_page`."""
        if data.numel() != self.page_nbytes:
            raise ValueError(f"page data has {data.numel()} bytes, expected {self.page_nbytes}")
        if self.digests is not None:
            self.digests.forget_pages([page])
        view = self.page_bytes(page)
        if view is not None:
            view.copy_(data)
            return
        target = self.paged.select(self.page_dim, page)
        target.copy_(data.view(self.spec.dtype).view(target.shape))


# Host memory an L2 pool must leave free (HiCache's 10 GiB): CacheConfig.host_memory_reserve_gib.
HOST_MEMORY_RESERVE_BYTES = 10 * 2**30


def host_pool_tokens(device_tokens: int, bytes_per_token: int, page_size: int,
                     ratio: float = 2.0, size_gb: float | None = None,
                     reserve_bytes: int = HOST_MEMORY_RESERVE_BYTES) -> int:
    """L2 size in tokens: ``size_gb`` when given and not 0 (overrides ``ratio``), else ``ratio`` x the L1 size.

    A host pool not larger than the device pool cannot hold anything L1 does not, so it is an error,
    and so is one larger than the host memory available now less ``reserve_bytes`` (HiCache keeps
    10 GiB for the rest of the process; the pool's pages are touched lazily, so the allocation itself
    would succeed and the process be killed later).
    """
    if size_gb:
        if not isinstance(size_gb, (int, float)) or size_gb <= 0:
            raise ValueError(f"hicache_size must be a positive number of GB, got {size_gb!r}")
        tokens = int(size_gb * 1e9) // bytes_per_token
    else:
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ValueError(f"hicache_ratio must be a positive number, got {ratio!r}")
        tokens = int(device_tokens * ratio)
    tokens -= tokens % page_size
    if tokens <= device_tokens:
        raise ValueError(f"host pool of {tokens} tokens is not larger than the device pool of "
                         f"{device_tokens} tokens (hicache_ratio={ratio!r}, hicache_size={size_gb!r})")
    available_bytes = available_host_memory_bytes()
    if available_bytes is not None and tokens * bytes_per_token > available_bytes - reserve_bytes:
        raise ValueError(f"host pool of {tokens} tokens needs {tokens * bytes_per_token / 1e9:.1f} GB but only "
                         f"{available_bytes / 1e9:.1f} GB of host memory is available, of which "
                         f"{reserve_bytes / 2**30:.1f} GiB stays free (host_memory_reserve_gib); lower "
                         f"hicache_ratio ({ratio!r}) or hicache_size_gb ({size_gb!r})")
    return tokens


def available_host_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
