"""L1 <-> L2 page copies as one Triton kernel per batch (per layer for a layer-wise load).

The kernel walks a page table and reads or writes the pinned host pool in place through its
device-mapped address: memory from ``cudaHostAlloc`` (torch's pinned allocator) is mapped into the
device's address space under unified addressing, and Triton's launcher translates a tensor's
``data_ptr()`` with ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``, so a pinned CPU
tensor is a valid kernel argument. No staging buffer, no per-(kv, layer) copy.

Both pools are seen as flat arrays of words (4, 2 or 1 bytes, the widest dividing a token row: the
copy moves bytes, whatever the dtype, fp8 included). A page's bytes fall into *chunks*: one token row
``[heads, dim]`` for one K/V and layer, or all of a page's rows for one (kv, layer) where both pools
keep them adjacent. Chunk offsets within page 0 come from the pools (:meth:`PagedKVBuffer.chunk_bases`)
once per pair of pools; a batch adds its page ids. Each program copies a tile of several chunks x a
block of words.

Which path runs is :func:`kernel_choice`: ``TIERKV_COPY_KERNEL=triton`` (also on CPU pools, where the
kernel needs Triton's interpreter, ``TRITON_INTERPRET=1``: the tests run that way), ``torch`` (the
copies in :mod:`tierkv.copy.device_copy` / :mod:`tierkv.copy.cpu_copy`), or unset/``auto``: Triton for CUDA pools
when it is installed, torch otherwise. Triton is imported on first use only: a CPU install needs none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import torch

from tierkv.pools.kv import HostKVPool, PagedKVBuffer, rows_adjacent_per_page

log = logging.getLogger(__name__)

ENV_VAR = "TIERKV_COPY_KERNEL"
CHOICES = ("auto", "triton", "torch")
# Words per program: enough bytes in flight per program to hide host-link latency, few enough
# programs for a small batch still to spread over the device.
_TILE_WORDS = 2048
_launches = 0  # kernel launches in this process (the tests check the path really ran)


def triton_available() -> bool:
    """Triton is importable (it is imported on first kernel use, not here)."""
    return _triton_module() is not None


@cache
def _triton_module() -> Any:
    try:
        import triton
    except ImportError:
        return None
    return triton


def kernel_choice() -> str:
    """``TIERKV_COPY_KERNEL``'s value, ``auto`` when unset; ValueError naming a bad one."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not one of {CHOICES}")
    return choice


_warned_missing = threading.Event()


def wanted(src: PagedKVBuffer, dst: PagedKVBuffer) -> bool:
    """Whether copies between these pools run on the Triton kernel (see module docstring)."""
    choice = kernel_choice()
    on_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
    if choice == "torch" or (choice == "auto" and not on_cuda):
        return False
    if not triton_available():
        if choice == "triton":
            raise ValueError(f"{ENV_VAR}=triton but triton is not installed (pip install triton)")
        if not _warned_missing.is_set():
            _warned_missing.set()
            log.warning("triton is not installed: L1<->L2 copies on CUDA take the torch path, several times "
                        "slower than the host link; pip install triton (or tierkv[gpu]) to fix")
        return False
    if not on_cuda and not _interpreting():
        raise ValueError(f"{ENV_VAR}=triton with CPU pools needs Triton's interpreter (TRITON_INTERPRET=1)")
    return True


def _reachable(src: PagedKVBuffer, dst: PagedKVBuffer) -> bool:
    """The kernel can address both pools: a host pool next to a CUDA one must be pinned (mapped)."""
    on_cuda = src.device.type == "cuda" or dst.device.type == "cuda"
    return not on_cuda or all(p.device.type == "cuda" or p.buffer.is_pinned() for p in (src, dst))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class PageTable:
    """A batch's source and destination page ids, ``int64 [2, pages]`` on the launch device."""

    pages: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.pages.shape[1]


class TritonPageCopy:
    """Copies whole pages from one pool to another (any layouts, same spec and page size) on the Triton
    kernel. Holds no reference to the pools (a cache of these must not keep their memory alive): only
    offsets and sizes, worked out once per pair."""

    def __init__(self, src: PagedKVBuffer, dst: PagedKVBuffer) -> None:
        if src.spec != dst.spec or src.page_size != dst.page_size:
            raise ValueError(f"pools differ: {src.spec}/{src.page_size} vs {dst.spec}/{dst.page_size}")
        self.device = dst.device if dst.device.type != "cpu" else src.device
        row_nbytes = src.rows.shape[1]
        self.word_nbytes = next(w for w in (4, 2, 1) if row_nbytes % w == 0)
        self.word_dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[self.word_nbytes]
        self.whole_pages = rows_adjacent_per_page(src, dst)
        host = src if isinstance(src, HostKVPool) else dst
        # page-major, then the host's memory order: consecutive programs walk host memory in order
        self.order = (2, *(d for d in host.row_dim_order if d != 2))
        chunk_rows = src.page_size if self.whole_pages else 1
        self.chunk_words = chunk_rows * row_nbytes // self.word_nbytes
        self.page_stride_words = (src.page_stride_nbytes // self.word_nbytes, dst.page_stride_nbytes // self.word_nbytes)
        self.num_pages = (src.num_pages, dst.num_pages)
        self._src_bases = {layer: src.chunk_bases(self.whole_pages, self.order, layer)[0]
                           for layer in (None, *range(src.spec.num_layers))}
        self._dst_bases = {layer: dst.chunk_bases(self.whole_pages, self.order, layer)[0]
                           for layer in (None, *range(src.spec.num_layers))}
        self._bases: dict[int | None, torch.Tensor] = {}
        self.block_words = min(_next_pow2(self.chunk_words), _TILE_WORDS)
        self.chunks_per_program = max(1, _TILE_WORDS // self.block_words)
        # every offset is a whole number of token rows: a vector-width hint the compiler may rely on
        self.vec = next(v for v in (4, 2, 1) if (row_nbytes // self.word_nbytes) % v == 0)

    def bases(self, layer: int | None) -> torch.Tensor:
        """Word offsets of page 0's chunks, ``int64 [2, chunks]`` (source, destination) on the device."""
        if layer not in self._bases:
            both = torch.stack([torch.from_numpy(self._src_bases[layer]), torch.from_numpy(self._dst_bases[layer])])
            self._bases[layer] = (both // self.word_nbytes).to(self.device)
        return self._bases[layer]

    def page_table(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> PageTable:
        """The batch's page ids on the device, checked against both pools (ValueError: nothing copied).
        Built once per batch; asynchronous on CUDA (a pinned staging copy on the current stream)."""
        pages = torch.stack([torch.as_tensor(src_pages, dtype=torch.int64).reshape(-1).cpu(),
                             torch.as_tensor(dst_pages, dtype=torch.int64).reshape(-1).cpu()])
        if pages.shape[1]:
            low, high = pages.min(dim=1).values.tolist(), pages.max(dim=1).values.tolist()
            for side, lo, hi, count in zip(("source", "destination"), low, high, self.num_pages):
                if lo < 0 or hi >= count:
                    raise ValueError(f"{side} page ids {lo}..{hi} outside the pool's {count} pages")
        if self.device.type == "cuda":
            pages = pages.pin_memory().to(self.device, non_blocking=True)
        return PageTable(pages)

    def copy(self, src: PagedKVBuffer, dst: PagedKVBuffer, table: PageTable, layer: int | None = None) -> None:
        """One kernel launch: all of the table's pages (``layer``: that layer's part of them only)."""
        global _launches
        if table.num_pages == 0:
            return
        bases = self.bases(layer)
        num_chunks = bases.shape[1]
        total = table.num_pages * num_chunks
        grid = (-(-total // self.chunks_per_program), -(-self.chunk_words // self.block_words))
        # Triton launches on the current device: make it the pools' (on the caller's current stream there)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            _kernel(_interpreting())[grid](
                _words(src, self.word_dtype), _words(dst, self.word_dtype), table.pages, bases,
                self.page_stride_words[0], self.page_stride_words[1], total, num_chunks, self.chunk_words,
                CHUNKS=self.chunks_per_program, BLOCK=self.block_words, VEC=self.vec, num_warps=4)
        _launches += 1

    def __call__(self, src: PagedKVBuffer, src_pages: torch.Tensor, dst: PagedKVBuffer, dst_pages: torch.Tensor,
                 layer: int | None = None) -> None:
        self.copy(src, dst, self.page_table(src_pages, dst_pages), layer)

    def layer_copier(self, src: PagedKVBuffer, src_pages: torch.Tensor, dst: PagedKVBuffer,
                     dst_pages: torch.Tensor) -> Callable[[int], None]:
        """``copy_layer(layer)`` for a layer-wise load: the page table built once for all layers."""
        table = self.page_table(src_pages, dst_pages)
        return lambda layer: self.copy(src, dst, table, layer)


def _words(pool: PagedKVBuffer, dtype: torch.dtype) -> torch.Tensor:
    return pool.rows.view(-1).view(dtype)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_copiers: "weakref.WeakKeyDictionary[PagedKVBuffer, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()
_copiers_lock = threading.Lock()


def copier_for(src: PagedKVBuffer, dst: PagedKVBuffer) -> TritonPageCopy | None:
    """The Triton copy between these two pools when :func:`wanted` and the kernel can reach both (a host
    pool beside a CUDA one is pinned), else None; made once per pair."""
    if not wanted(src, dst):
        return None
    with _copiers_lock:
        per_src = _copiers.setdefault(src, weakref.WeakKeyDictionary())
        if dst not in per_src:
            per_src[dst] = TritonPageCopy(src, dst) if _reachable(src, dst) else None
        copier = per_src[dst]
    if copier is None and kernel_choice() == "triton":
        raise ValueError(f"{ENV_VAR}=triton needs a pinned host pool (the kernel reads it in place)")
    return copier


def launches() -> int:
    """Kernel launches so far in this process."""
    return _launches


@cache
def _kernel(interpreted: bool) -> Any:
    """The copy kernel, compiled on first use, or run by Triton's interpreter when ``interpreted`` (Triton
    reads TRITON_INTERPRET when a kernel is defined: one definition per mode, so a process whose tests
    turn the interpreter on and off gets each right)."""
    triton = _triton_module()
    if triton is None:
        raise RuntimeError("the Triton copy kernel needs triton (pip install triton)")
    import triton.language as tl

    @triton.jit
    def copy_chunks(src, dst, pages, bases, src_page_stride, dst_page_stride, total, num_chunks, chunk_words,
                    CHUNKS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
        # a tile: CHUNKS (page, chunk) pairs x BLOCK words of each
        ids = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
        live = ids < total
        page_i, chunk = ids // num_chunks, ids % num_chunks
        num_pages = total // num_chunks
        src_at = (tl.load(pages + page_i, mask=live, other=0) * src_page_stride
                  + tl.load(bases + chunk, mask=live, other=0))
        dst_at = (tl.load(pages + num_pages + page_i, mask=live, other=0) * dst_page_stride
                  + tl.load(bases + num_chunks + chunk, mask=live, other=0))
        src_at, dst_at = tl.multiple_of(src_at, VEC), tl.multiple_of(dst_at, VEC)
        word = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = live[:, None] & (word[None, :] < chunk_words)
        values = tl.load(src + src_at[:, None] + word[None, :], mask=mask)
        tl.store(dst + dst_at[:, None] + word[None, :], values, mask=mask)

    return copy_chunks
