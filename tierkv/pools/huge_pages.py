"""Transparent huge pages for large CPU pool buffers.

Why: an L1 <-> L2 copy at page 1 moves one 2 KiB chunk per token and layer, from pages scattered over a pool of
hundreds of MiB; on 4 KiB memory pages each chunk is its own TLB miss. Where the kernel's transparent huge
pages are in "madvise" mode (a common default, and this project's CI machine's), memory gets 2 MiB pages only
where it is advised to: advised, the page-1 copies of ``bench/bench_copy.py`` (64 tokens, a 512 MiB L1) moved
46-48 GB/s instead of 39-42. The advice must come before the memory is first touched, which the pools do right
after (they zero their buffers). Advice only: a kernel or platform without it leaves the pool as it was.
``TIERKV_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Callable

import torch

HUGE_PAGE_NBYTES = 2 << 20  # x86-64's and arm64's (4 KiB base pages) PMD size
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


def _bind_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _bind_madvise()


def advise_huge_pages(buffer: torch.Tensor) -> int:
    """Ask the kernel to back the whole 2 MiB pages inside ``buffer``'s memory (a contiguous, unpinned CPU
    tensor, not yet touched) with huge pages; the bytes advised, 0 when none were (off, not Linux, pinned or
    on a device, under 2 MiB of aligned memory, or refused)."""
    if (_madvise is None or os.environ.get("TIERKV_HUGE_PAGES", "1") == "0" or buffer.device.type != "cpu"
            or not buffer.is_contiguous() or buffer.is_pinned()):
        return 0
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    first = -(-start // HUGE_PAGE_NBYTES) * HUGE_PAGE_NBYTES
    last = end // HUGE_PAGE_NBYTES * HUGE_PAGE_NBYTES
    if last <= first or _madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return 0
    return last - first
