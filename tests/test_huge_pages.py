"""Huge pages for large CPU pool buffers (tierkv/pools/huge_pages.py): advised before the first touch, so a
pool's memory is backed by 2 MiB pages where the kernel does that on advice, and nothing advised where it
cannot or must not be."""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tierkv.pools import kv
from tierkv.pools.huge_pages import HUGE_PAGE_NBYTES, advise_huge_pages
from tierkv.pools.kv import DeviceKVPool, HostKVPool
from tierkv.pools.spec import KVSpec

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float16)  # 1 KiB a token
POOLS = [lambda: DeviceKVPool(SPEC, 32 * 1024, 16, "cpu"),
         lambda: HostKVPool(SPEC, 32 * 1024, 16, "page_first", pin_memory=False)]
on_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")


def _thp_on_advice() -> bool:
    """Whether this kernel backs advised memory with huge pages ("always" or "madvise" selected)."""
    try:
        return re.search(r"\[(always|madvise)\]", THP_MODE.read_text()) is not None
    except OSError:
        return False


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields (Rss, AnonHugePages, VmFlags, ...) of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if inside:
                break
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def kib(field: str) -> int:
    return int(field.split()[0])


def resident_kib(buffer: torch.Tensor) -> int:
    """KiB of ``buffer``'s whole 4 KiB pages resident in memory (``mincore``): 0 for memory never touched."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    start = -(-buffer.data_ptr() // 4096) * 4096
    num_pages = (buffer.data_ptr() + buffer.nbytes - start) // 4096
    flags = ctypes.create_string_buffer(num_pages)
    assert libc.mincore(start, num_pages * 4096, flags) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in flags.raw) * 4


def check_pool_advice(which: int) -> tuple[int, int, str, int]:
    """Build pool ``which`` of POOLS with the advice recorded: KiB of its buffer resident when advised and
    after, the mapping's VmFlags and AnonHugePages KiB. Run in a fresh process (see the test)."""
    resident = []

    def advise_and_record(buffer: torch.Tensor) -> int:
        resident.append(resident_kib(buffer))
        return advise_huge_pages(buffer)
    kv.advise_huge_pages = advise_and_record
    pool = POOLS[which]()  # 32 MiB
    assert len(resident) == 1, resident
    mapping = mapping_of(pool.buffer.data_ptr() + pool.buffer.nbytes // 2)
    return resident[0], resident_kib(pool.buffer), mapping["VmFlags"], kib(mapping.get("AnonHugePages", "0 kB"))


@on_linux
@pytest.mark.skipif(not THP_MODE.exists(), reason="this kernel has no transparent huge pages")
@pytest.mark.parametrize("which", [0, 1], ids=["L1 on CPU", "L2 unpinned"])
def test_a_large_cpu_pool_is_advised_before_its_memory_is_touched(which):
    """The advice only works on memory not yet faulted in: the pool gives it before zeroing its buffer. The
    mapping then carries the kernel's huge-page flag (``hg``). In a fresh process, where the allocator hands a
    32 MiB buffer new memory (in a long test run it may recycle memory already touched). Whether the kernel
    found huge pages for it (fragmented memory may keep it from that) is a warning, not a failure."""
    code = f"from tests.test_huge_pages import check_pool_advice; print(repr(check_pool_advice({which})))"
    env = {k: v for k, v in os.environ.items() if k != "TIERKV_HUGE_PAGES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, vm_flags, huge = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert before < 64, f"{before} KiB of the buffer resident when advised"
    assert after >= 32 * 1024 - 8, "zeroed: every page resident"
    assert "hg" in vm_flags.split(), vm_flags
    if _thp_on_advice() and huge == 0:
        warnings.warn("advised pool memory got no huge pages (fragmented memory?)")


def test_nothing_is_advised_when_off_small_or_strided(monkeypatch):
    monkeypatch.setenv("TIERKV_HUGE_PAGES", "0")
    assert advise_huge_pages(torch.empty(16 << 20, dtype=torch.uint8)) == 0
    monkeypatch.delenv("TIERKV_HUGE_PAGES")
    assert advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)) == 0, "no whole 2 MiB page inside"
    assert advise_huge_pages(torch.empty(4096, 4096, dtype=torch.uint8).t()) == 0, "not contiguous"


@on_linux
def test_the_whole_aligned_pages_inside_a_buffer_are_advised(monkeypatch):
    monkeypatch.delenv("TIERKV_HUGE_PAGES", raising=False)
    buffer = torch.empty(9 << 20, dtype=torch.uint8)
    start = buffer.data_ptr()
    first = -(-start // HUGE_PAGE_NBYTES) * HUGE_PAGE_NBYTES
    last = (start + buffer.nbytes) // HUGE_PAGE_NBYTES * HUGE_PAGE_NBYTES
    assert advise_huge_pages(buffer) == last - first >= 3 * HUGE_PAGE_NBYTES
