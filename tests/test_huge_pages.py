"""Huge pages for large CPU pool buffers (tierkv/pools/huge_pages.py): advised before the first touch, so a
pool's memory is backed by 2 MiB pages where the kernel does that on advice, and nothing advised where it
cannot or must not be."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tierkv.pools.huge_pages import HUGE_PAGE_NBYTES, advise_huge_pages
from tierkv.pools.kv import DeviceKVPool, HostKVPool
from tierkv.pools.spec import KVSpec

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on_advice() -> bool:
    """Whether this kernel backs advised memory with huge pages ("always" or "madvise" selected)."""
    try:
        return re.search(r"\[(always|madvise)\]", THP_MODE.read_text()) is not None
    except OSError:
        return False


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not _thp_on_advice(),
                               reason="transparent huge pages are off (or not Linux)")
SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float16)  # 1 KiB a token


@needs_thp
@pytest.mark.parametrize("make", [lambda: DeviceKVPool(SPEC, 32 * 1024, 16, "cpu"),
                                  lambda: HostKVPool(SPEC, 32 * 1024, 16, "page_first", pin_memory=False)],
                         ids=["L1 on CPU", "L2 unpinned"])
def test_a_large_cpu_pool_is_backed_by_huge_pages(make, monkeypatch):
    monkeypatch.delenv("TIERKV_HUGE_PAGES", raising=False)
    pool = make()  # 32 MiB, zeroed by the pool right after the advice
    assert huge_bytes_at(pool.buffer.data_ptr() + pool.buffer.nbytes // 2) >= HUGE_PAGE_NBYTES


def test_nothing_is_advised_when_off_small_or_strided(monkeypatch):
    monkeypatch.setenv("TIERKV_HUGE_PAGES", "0")
    assert advise_huge_pages(torch.empty(16 << 20, dtype=torch.uint8)) == 0
    monkeypatch.delenv("TIERKV_HUGE_PAGES")
    assert advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)) == 0, "no whole 2 MiB page inside"
    assert advise_huge_pages(torch.empty(4096, 4096, dtype=torch.uint8).t()) == 0, "not contiguous"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_the_whole_aligned_pages_inside_a_buffer_are_advised(monkeypatch):
    monkeypatch.delenv("TIERKV_HUGE_PAGES", raising=False)
    buffer = torch.empty(9 << 20, dtype=torch.uint8)
    start = buffer.data_ptr()
    first = -(-start // HUGE_PAGE_NBYTES) * HUGE_PAGE_NBYTES
    last = (start + buffer.nbytes) // HUGE_PAGE_NBYTES * HUGE_PAGE_NBYTES
    assert advise_huge_pages(buffer) == last - first >= 3 * HUGE_PAGE_NBYTES
