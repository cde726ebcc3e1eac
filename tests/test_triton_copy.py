"""The Triton page copy (tierkv/copy/triton_copy.py), on CPU under Triton's interpreter: bit for bit the
reference gather/scatter for every layout, page size, dtype, attention kind and page pattern, whole and
layer by layer; through the transfer controller and the cache with the kernel path switched on."""

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pool_helpers import random_pools
from tierkv.cache.config import CacheConfig
from tierkv.copy import triton_copy
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, HostKVPool, KVSpec
from tierkv.radix import RadixKey
from tierkv.copy.transfer import TransferController


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    """Triton (skip without it), its interpreter and the kernel path on, for this module's tests only."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(triton_copy.ENV_VAR, "triton")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def make_spec(attention: str, dtype: torch.dtype, num_layers: int = 3) -> KVSpec:
    if attention == "mla":
        return KVSpec(num_layers, attention="mla", kv_lora_rank=12, rope_dim=4, dtype=dtype)
    return KVSpec(num_layers, kv_heads=2, head_dim=8, dtype=dtype)


def page_pattern(pattern: str, num_pages: int, pool_pages: int, seed: int) -> torch.Tensor:
    """``num_pages`` page ids of a pool of ``pool_pages``: in random order, ascending with gaps, or one run."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "shuffled":
        return torch.randperm(pool_pages, generator=g)[:num_pages]
    if pattern == "fragmented":
        return torch.randperm(pool_pages, generator=g)[:num_pages].sort().values
    first = int(torch.randint(0, pool_pages - num_pages + 1, (1,), generator=g))
    return torch.arange(first, first + num_pages)


def reference_copy(src, src_pages, dst, dst_pages, layer=None) -> torch.Tensor:
    """dst's buffer after the copy, as torch's index_select / index_copy_ over the pools' byte views make
    it (any dtype, fp8 included); dst itself unchanged."""
    src_bytes, want = src.paged.view(torch.uint8), dst.buffer.clone()
    dst_bytes = want.view(torch.uint8).view(dst.paged.view(torch.uint8).shape)
    if dst.paged.data_ptr() != dst.buffer.data_ptr() or dst_bytes.shape != dst.paged.view(torch.uint8).shape:
        raise AssertionError("a paged view that is not the whole buffer")
    data = src_bytes.index_select(src.page_dim, src_pages).permute(src.perm)
    if layer is not None:  # only that layer: keep the destination's other layers
        kept = dst_bytes.index_select(dst.page_dim, dst_pages).permute(dst.perm).clone()
        kept[:, layer] = data[:, layer]
        data = kept
    dst_bytes.index_copy_(dst.page_dim, dst_pages, data.permute(dst.inverse_perm))
    return want


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run_case(attention, dtype, layout, page_size, pattern, num_pages, to_host, seed=0):
    spec = make_spec(attention, dtype)
    device, host = random_pools(spec, layout, page_size, device_pages=8, host_pages=12, seed=seed)
    device_pages = page_pattern(pattern, num_pages, device.num_pages, seed)
    host_pages = page_pattern(pattern, num_pages, host.num_pages, seed + 1)
    src, src_pages, dst, dst_pages = ((device, device_pages, host, host_pages) if to_host
                                      else (host, host_pages, device, device_pages))
    want = reference_copy(src, src_pages, dst, dst_pages)
    launches = triton_copy.launches()
    triton_copy.copier_for(src, dst)(src, src_pages, dst, dst_pages)
    assert triton_copy.launches() == launches + 1  # one kernel for the batch
    assert same_bytes(dst.buffer, want)


@pytest.mark.parametrize("to_host", [True, False], ids=["write", "load"])
@pytest.mark.parametrize("pattern", ["shuffled", "fragmented", "contiguous"])
@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_copy_is_bit_exact(attention, layout, page_size, pattern, to_host):
    run_case(attention, torch.bfloat16, layout, page_size, pattern, num_pages=5, to_host=to_host)


@pytest.mark.parametrize("to_host", [True, False], ids=["write", "load"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_every_dtype_moves_as_bytes(attention, layout, dtype, to_host):
    run_case(attention, DTYPES[dtype], layout, 4, "shuffled", num_pages=6, to_host=to_host, seed=3)


@pytest.mark.parametrize("num_pages", [1, 3, 8])  # one page, a partial batch, every page of L1
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_partial_and_whole_batches(layout, num_pages):
    for to_host in (True, False):
        run_case("mha", torch.float16, layout, 4, "shuffled", num_pages, to_host, seed=num_pages)


def test_odd_row_widths_use_narrow_words():
    """A token row of 3 fp16 values (6 bytes) moves as 2-byte words; 1 fp8 value as single bytes."""
    for dtype, heads, dim, word in ((torch.float16, 1, 3, 2), (torch.float8_e4m3fn, 1, 1, 1)):
        spec = KVSpec(2, kv_heads=heads, head_dim=dim, dtype=dtype)
        device, host = random_pools(spec, "page_first", 2, device_pages=4, host_pages=6)
        copier = triton_copy.copier_for(host, device)
        assert copier.word_nbytes == word
        want = reference_copy(host, torch.tensor([5, 0]), device, torch.tensor([1, 3]))
        copier(host, torch.tensor([5, 0]), device, torch.tensor([1, 3]))
        assert same_bytes(device.buffer, want)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_layer_wise_load_moves_one_layer_per_launch(attention, layout, page_size):
    spec = make_spec(attention, torch.bfloat16)
    device, host = random_pools(spec, layout, page_size, device_pages=6, host_pages=10, seed=5)
    host_pages, device_pages = torch.tensor([7, 2, 9, 4]), torch.tensor([3, 0, 5, 1])
    copier = triton_copy.copier_for(host, device)
    copy_layer = copier.layer_copier(host, host_pages, device, device_pages)
    for layer in range(spec.num_layers):  # after each launch: that layer landed, later ones untouched
        want = reference_copy(host, host_pages, device, device_pages, layer=layer)
        copy_layer(layer)
        assert same_bytes(device.buffer, want)
    assert same_bytes(device.buffer, reference_copy(host, host_pages, device, device_pages))


def test_bad_page_ids_copy_nothing():
    device, host = random_pools(make_spec("mha", torch.float16), "layer_first", 4, device_pages=4, host_pages=6)
    before = device.buffer.clone()
    copier = triton_copy.copier_for(host, device)
    with pytest.raises(ValueError, match="source page ids 0..6 outside the pool's 6 pages"):
        copier(host, torch.tensor([0, 6]), device, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="destination page ids -1..1"):
        copier(host, torch.tensor([0, 1]), device, torch.tensor([-1, 1]))
    assert same_bytes(device.buffer, before)


def test_switch_values(monkeypatch):
    device, host = random_pools(make_spec("mha", torch.float16), "page_first", 1, device_pages=2, host_pages=4)
    monkeypatch.setenv(triton_copy.ENV_VAR, "torch")
    assert triton_copy.copier_for(device, host) is None
    monkeypatch.setenv(triton_copy.ENV_VAR, "auto")  # auto: CPU pools keep the CPU copies
    assert triton_copy.copier_for(device, host) is None
    monkeypatch.setenv(triton_copy.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="TIERKV_COPY_KERNEL='cuda' is not one of"):
        triton_copy.copier_for(device, host)
    monkeypatch.setenv(triton_copy.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs Triton's interpreter"):
        triton_copy.copier_for(device, host)


def test_cuda_without_triton_logs_once_and_takes_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(triton_copy, "triton_available", lambda: False)
    monkeypatch.setattr(triton_copy, "_warned_missing", triton_copy.threading.Event())
    monkeypatch.setenv(triton_copy.ENV_VAR, "auto")
    on_cuda = SimpleNamespace(device=torch.device("cuda"))
    host = SimpleNamespace(device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger=triton_copy.__name__):
        assert triton_copy.copier_for(on_cuda, host) is None
        assert triton_copy.copier_for(host, on_cuda) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "pip install triton" in warnings[0]
    monkeypatch.setenv(triton_copy.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="triton is not installed"):
        triton_copy.copier_for(on_cuda, host)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_transfer_controller_runs_the_kernel(layout):
    spec = make_spec("mha", torch.bfloat16)
    device, host = random_pools(spec, layout, 4, device_pages=6, host_pages=10, seed=2)
    transfer = TransferController(device, host, "kernel")
    try:
        device_slots = device.allocator.pages_to_slots(torch.tensor([4, 1, 2]))
        host_slots = host.allocator.pages_to_slots(torch.tensor([8, 3, 0]))
        launches = triton_copy.launches()
        want_host = reference_copy(device, torch.tensor([4, 1, 2]), host, torch.tensor([8, 3, 0]))
        assert transfer.write(device_slots, host_slots).wait()
        assert same_bytes(host.buffer, want_host)
        device.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
        want_device = reference_copy(host, torch.tensor([8, 3, 0]), device, torch.tensor([4, 1, 2]))
        assert transfer.load_layers(host_slots, device_slots, [None]).wait()
        assert same_bytes(device.buffer, want_device)
        assert transfer.load_now(host_slots, device_slots) is None
        assert triton_copy.launches() == launches + 1 + spec.num_layers + 1
    finally:
        transfer.shutdown()


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_cache_round_trip_on_the_kernel_path(attention, layout):
    """HiRadixCache with the kernel path on: insert, write through to L2, evict, load back, same bits."""
    page_size = 4
    spec = make_spec(attention, torch.float16, num_layers=2)
    pool = DeviceKVPool(spec, 8 * page_size, page_size, "cpu")
    cache = HiRadixCache(pool, CacheConfig(page_size=page_size, host_layout=layout, load_back_threshold=0))
    try:
        tokens = list(range(100, 100 + 5 * page_size))
        slots = cache.alloc_device(len(tokens))
        g = torch.Generator().manual_seed(11)
        kv = torch.randint(0, 256, (spec.num_kv, spec.num_layers, len(slots), spec.heads, spec.dim * 2),
                           dtype=torch.uint8, generator=g).view(spec.dtype)
        pool.write_tokens(slots, kv)
        cache.insert(RadixKey(tokens), slots)
        launches = triton_copy.launches()
        cache.flush()  # the write-through lands in L2
        assert cache.evict(pool.num_slots) == len(tokens)
        pool.buffer.zero_()
        match = cache.match_prefix(RadixKey(tokens))
        assert len(match.device_indices) == 0 and match.host_hit_length == len(tokens)
        load = cache.init_load_back(match.last_host_node)
        assert load.pending is not None and load.pending.wait()
        assert same_bytes(pool.read_tokens(load.device_indices), kv)
        assert triton_copy.launches() >= launches + 1  # the load (the write may have run at insert)
        cache.step()
        cache.check_integrity()
    finally:
        cache.close()


def test_cpu_install_needs_no_triton():
    """With triton unimportable, CPU copies run as before and asking for the kernel names the fix."""
    code = """
import sys, os, torch
sys.modules["triton"] = None  # import triton -> ImportError
sys.path.insert(0, "tests")
from pool_helpers import random_pools
from tierkv.pools import KVSpec
from tierkv.copy.transfer import TransferController
device, host = random_pools(KVSpec(2, kv_heads=1, head_dim=4, dtype=torch.float16), "layer_first", 2, 4, 6)
os.environ["TIERKV_COPY_KERNEL"] = "auto"
t = TransferController(device, host, "kernel")
t.write(device.allocator.pages_to_slots(torch.tensor([1])), host.allocator.pages_to_slots(torch.tensor([2]))).wait()
t.shutdown()
assert torch.equal(host.gather_pages(torch.tensor([2])).view(torch.uint8), device.gather_pages(torch.tensor([1])).view(torch.uint8))
os.environ["TIERKV_COPY_KERNEL"] = "triton"
try:
    TransferController(device, host, "kernel")
except ValueError as exc:
    print("error:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert "error: TIERKV_COPY_KERNEL=triton but triton is not installed" in out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_compiled_kernel_on_cuda_reads_and_writes_pinned_host_memory(monkeypatch, attention, layout):
    """On a GPU, compiled (no interpreter): the host pool is pinned and read/written in place."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = make_spec(attention, torch.bfloat16)
    device = DeviceKVPool(spec, 8 * 16, 16, "cuda")
    host = HostKVPool(spec, 12 * 16, 16, layout, pin_memory=True)
    device.buffer.view(torch.uint8).random_(0, 256)
    host.buffer.view(torch.uint8).random_(0, 256)
    device_pages, host_pages = torch.tensor([6, 1, 3]), torch.tensor([11, 0, 5])
    triton_copy.copier_for(device, host)(device, device_pages, host, host_pages)
    torch.cuda.synchronize()
    assert same_bytes(host.gather_pages(host_pages), device.gather_pages(device_pages).cpu())
    copy_layer = triton_copy.copier_for(host, device).layer_copier(host, host_pages, device, torch.tensor([0, 2, 7]))
    for layer in range(spec.num_layers):
        copy_layer(layer)
    torch.cuda.synchronize()
    assert same_bytes(device.gather_pages(torch.tensor([0, 2, 7])), device.gather_pages(device_pages))


def test_a_host_pool_beside_a_cuda_pool_must_be_pinned():
    def pool(device, pinned):
        return SimpleNamespace(device=torch.device(device), buffer=SimpleNamespace(is_pinned=lambda: pinned))

    assert not triton_copy._reachable(pool("cuda", False), pool("cpu", False))  # pageable: not mapped
    assert triton_copy._reachable(pool("cpu", True), pool("cuda", False))
    assert triton_copy._reachable(pool("cpu", False), pool("cpu", False))  # the interpreter: plain pointers
