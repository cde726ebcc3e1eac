"""KV pools: shapes and dtypes, the slot allocator, host sizing and layouts, page byte access."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, HostKVPool, KVSpec, SlotAllocator, allocator, host_pool_tokens

MHA = KVSpec(num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float16)
MLA = KVSpec(num_layers=3, attention="mla", kv_lora_rank=6, rope_dim=2, dtype=torch.bfloat16)


def test_mha_shapes_and_bytes():
    pool = DeviceKVPool(MHA, 32, 4, "cpu")
    assert pool.k_buffer(1).shape == (32, 2, 4) and pool.v_buffer(2).shape == (32, 2, 4)
    assert pool.k_buffer(0).dtype == torch.float16
    assert MHA.bytes_per_token == 2 * 3 * 2 * 4 * 2
    assert pool.size_bytes == 32 * MHA.bytes_per_token
    assert pool.page_nbytes == 4 * MHA.bytes_per_token


def test_mla_shapes_and_bytes():
    pool = DeviceKVPool(MLA, 16, 1, "cpu")
    assert pool.latent_buffer(2).shape == (16, 1, 8)
    assert pool.latent_buffer(0).dtype == torch.bfloat16
    assert MLA.bytes_per_token == 3 * 8 * 2
    with pytest.raises(ValueError, match="latent"):
        pool.v_buffer(0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                                   torch.uint8, torch.float8_e4m3fn, "bfloat16", "torch.float32"])
def test_any_real_dtype(dtype):
    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=2, dtype=dtype)
    pool = DeviceKVPool(spec, 4, 1, "cpu")
    assert pool.buffer.dtype == spec.dtype
    assert spec.bytes_per_token == 2 * 2 * spec.dtype.itemsize


@pytest.mark.parametrize("dtype", ["float17", torch.complex64, torch.bool, 3])
def test_wrong_dtype_is_a_value_error_naming_it(dtype):
    with pytest.raises(ValueError, match="dtype"):
        KVSpec(num_layers=1, kv_heads=1, head_dim=2, dtype=dtype)


def test_allocator_hands_out_whole_pages_until_full(allocator_impl):
    alloc = SlotAllocator(16, 4)
    a = alloc.alloc(8)
    assert a.tolist() == list(range(8))
    b = alloc.alloc(8)
    assert alloc.alloc(4) is None
    assert alloc.num_free_slots == 0 and alloc.num_used_slots == 16
    alloc.free(a)
    assert alloc.num_free_slots == 8
    assert sorted(alloc.alloc(8).tolist()) == list(range(8))
    with pytest.raises(ValueError, match="multiple"):
        alloc.alloc(3)
    alloc.free(b)


def test_allocator_double_free_is_an_error(allocator_impl):
    alloc = SlotAllocator(8, 2)
    slots = alloc.alloc(4)
    alloc.free(slots)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots)
    other = alloc.alloc(2)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.cat([other, other]))
    with pytest.raises(ValueError, match="double free"):  # a repeat that is not adjacent
        alloc.free(torch.cat([other, alloc.alloc(2), other]))
    assert alloc.owned_mask().sum() == 2  # a rejected free changes nothing


def test_allocator_rejects_partial_or_foreign_pages(allocator_impl):
    alloc = SlotAllocator(8, 4)
    alloc.alloc(8)
    with pytest.raises(ValueError, match="whole"):
        alloc.free(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="aligned"):
        alloc.free(torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="range"):
        SlotAllocator(8, 1).free(torch.tensor([8]))


def test_allocator_sizes_are_validated():
    with pytest.raises(ValueError, match="page_size"):
        SlotAllocator(8, 0)
    with pytest.raises(ValueError, match="num_slots"):
        SlotAllocator(2, 4)
    with pytest.raises(ValueError, match="smaller than one page"):
        DeviceKVPool(MHA, 2, 4, "cpu")


def test_host_size_by_ratio_and_by_gb():
    assert host_pool_tokens(100, 1000, 4, ratio=2.5) == 248  # cut to whole pages
    # size_gb overrides the ratio
    assert host_pool_tokens(100, 1000, 1, ratio=0.5, size_gb=0.001) == 1000


def test_host_not_larger_than_device_is_an_error_with_the_numbers():
    with pytest.raises(ValueError) as err:
        host_pool_tokens(100, 1000, 1, ratio=1.0)
    assert "100 tokens" in str(err.value) and "hicache_ratio=1.0" in str(err.value)
    with pytest.raises(ValueError) as err:
        host_pool_tokens(100, 1000, 1, size_gb=0.00005)
    assert "50 tokens" in str(err.value) and "100 tokens" in str(err.value)
    for bad in (0, -1.0, "2"):
        with pytest.raises(ValueError, match=repr(bad).replace("-", "\\-")):
            host_pool_tokens(100, 1000, 1, ratio=bad)
    for bad in (-1.0, "2"):  # size 0 means "use the ratio" (HiCache's hicache_size=0)
        with pytest.raises(ValueError, match=repr(bad).replace("-", "\\-")):
            host_pool_tokens(100, 1000, 1, size_gb=bad)


def test_unknown_host_layout_is_an_error():
    with pytest.raises(ValueError, match="'page_last'"):
        HostKVPool(MHA, 8, 1, "page_last")


def _random_kv(spec: KVSpec, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_kv, spec.num_layers, n, spec.heads, spec.dim)
    return torch.randn(shape, generator=g).to(spec.dtype)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec", [MHA, MLA], ids=["mha", "mla"])
def test_host_layouts_store_tokens_where_expected(layout, spec):
    pool = HostKVPool(spec, 16, 4, layout, pin_memory=False)
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    kv = _random_kv(spec, 8)
    pool.write_tokens(slots, kv)
    assert torch.equal(pool.read_tokens(slots), kv)
    assert torch.equal(pool.read_tokens(slots[4:]), kv[:, :, 4:])
    # the raw buffer's layout: token 8 of layer 1, K, sits where the layout says
    expected = kv[0, 1, 0]
    if layout == "layer_first":
        assert torch.equal(pool.buffer[0, 1, 8], expected)
    elif layout == "page_first":
        assert torch.equal(pool.buffer[8, 0, 1], expected)
    else:
        assert torch.equal(pool.buffer[2, 0, 1, 0], expected)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_page_bytes_read_page_write_page(layout):
    pool = HostKVPool(MHA, 16, 4, layout, pin_memory=False)
    kv = _random_kv(MHA, 16, seed=1)
    pool.write_tokens(torch.arange(16), kv)
    data = pool.read_page(2).clone()
    assert data.dtype == torch.uint8 and data.numel() == pool.page_nbytes
    view = pool.page_bytes(2)
    if layout == "layer_first":
        assert view is None
    else:
        assert torch.equal(view, data)
    pool.write_page(0, data)
    assert torch.equal(pool.read_tokens(torch.arange(4)), kv[:, :, 8:12])
    with pytest.raises(ValueError, match="bytes"):
        pool.write_page(0, data[:-1])


def test_layer_first_and_page_first_direct_share_page_bytes():
    """Both order a page's bytes [kv, layer, token, head, dim]; page_first (token outermost) differs, which
    is why the storage namespace names the layout."""
    a = HostKVPool(MLA, 8, 2, "layer_first", pin_memory=False)
    b = HostKVPool(MLA, 8, 2, "page_first_direct", pin_memory=False)
    kv = _random_kv(MLA, 8, seed=2)
    a.write_tokens(torch.arange(8), kv)
    for page in range(4):
        b.write_page(page, a.read_page(page))
    assert torch.equal(b.read_tokens(torch.arange(8)), kv)


def test_pools_start_zeroed():
    pool = HostKVPool(MHA, 8, 1, "page_first", pin_memory=False)
    assert int(pool.buffer.count_nonzero()) == 0


def _reference_pages(slots: torch.Tensor, page_size: int) -> list[int] | None:
    """Page ids of whole aligned pages, slot by slot (the plain definition); None when not whole pages."""
    ids = slots.tolist()
    if len(ids) % page_size:
        return None
    pages = []
    for i in range(0, len(ids), page_size):
        chunk = ids[i:i + page_size]
        if chunk[0] % page_size or chunk != list(range(chunk[0], chunk[0] + page_size)):
            return None
        pages.append(chunk[0] // page_size)
    return pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_slot_page_conversion_fast_paths_match_the_plain_definition(page_size, allocator_impl):
    """Runs of slots take a fast path, scattered pages the general one: both give the plain result."""
    alloc = SlotAllocator(64 * page_size, page_size)
    run = alloc.alloc(8 * page_size)
    gaps = torch.cat([alloc.pages_to_slots(torch.tensor(p)) for p in ([20, 21], [30], [25, 26, 27])])
    for slots in (run, gaps, run[page_size:3 * page_size], torch.cat([run[2 * page_size:], run[:page_size]])):
        expected = _reference_pages(slots, page_size)
        assert alloc.slots_to_pages(slots).tolist() == expected
        assert alloc._slots_to_pages(slots, every_slot=True).tolist() == expected
        assert alloc.pages_to_slots(torch.tensor(expected)).tolist() == slots.tolist()


def test_misaligned_or_partial_pages_are_refused_by_every_check(allocator_impl):
    alloc = SlotAllocator(64, 4)
    held = alloc.alloc(16)
    shifted = held + 1
    for every_slot in (True, False):
        with pytest.raises(ValueError, match="aligned"):
            alloc._slots_to_pages(shifted, every_slot)
        with pytest.raises(ValueError, match="whole pages"):
            alloc._slots_to_pages(held[:6], every_slot)
    inner = held.clone()
    inner[5] = 40  # a page whose first and last slot are right: only the full check sees it
    with pytest.raises(ValueError, match="aligned"):
        alloc.check_allocated(inner, "slots")
    alloc.free(held)
    assert alloc.num_free_slots == 64


@pytest.mark.skipif(allocator.native is None, reason="tierkv.copy._rowcopy is not built")
@settings(max_examples=200, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), held=st.lists(st.booleans(), min_size=8, max_size=8),
       picks=st.lists(st.integers(-1, 9), max_size=6), shift=st.integers(-1, 1), cut=st.integers(0, 2))
def test_native_checks_agree_with_the_numpy_reference(page_size, held, picks, shift, cut):
    """free and check_allocated accept, refuse (same error) and change state exactly as the reference
    does, for any slots: pages free or held, repeated, out of range, shifted or cut short."""
    pages = torch.tensor(picks, dtype=torch.int64)
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1) + shift
    slots = slots[:max(0, len(slots) - cut)]
    outcomes = []
    for impl in (allocator.native, None):
        alloc = SlotAllocator(8 * page_size, page_size)
        alloc._is_free[:] = ~np.array(held)
        alloc._free_pages = np.flatnonzero(alloc._is_free)
        saved, allocator.native = allocator.native, impl
        try:
            outcome = []
            for check in (lambda: alloc.check_allocated(slots, "slots"), lambda: alloc.free(slots)):
                try:
                    check()
                    outcome.append("ok")
                except ValueError as exc:
                    outcome.append(str(exc))
            alloc._merge_released()
            outcome.append((alloc._is_free.tolist(), alloc._free_pages.tolist()))
            outcome.append(alloc.pages_to_slots(torch.tensor([3, 1, 2])).tolist())
        finally:
            allocator.native = saved
        outcomes.append(outcome)
    assert outcomes[0] == outcomes[1]


# ---- plain slot slices ----------------------------------------------------------------------------------
def test_a_plain_slot_slice_aliases_its_storage_without_a_view_record():
    from tierkv.pools.allocator import plain_slot_slices

    slots = torch.arange(64, dtype=torch.int64)
    with plain_slot_slices():
        part = slots[16:48]
    assert not part._is_view() and part._base is None  # no autograd record to make or free
    assert part.untyped_storage().data_ptr() == slots.untyped_storage().data_ptr()
    assert part.tolist() == list(range(16, 48))
    assert slots[16:48]._is_view()  # outside the context, slicing is as before


def test_plain_slot_slices_fall_back_to_plain_slicing_without_the_guard(monkeypatch):
    import tierkv.pools.allocator as allocator

    monkeypatch.setattr(allocator, "_BELOW_VIEW_TRACKING", None)
    with allocator.plain_slot_slices():
        part = torch.arange(8)[2:6]
    assert part.tolist() == [2, 3, 4, 5]


def test_the_caches_nodes_hold_plain_slices_of_the_inserted_slots():
    """HiRadixCache.insert and eviction's splits slice under plain_slot_slices: the tree's slices cost
    half as much to make and to free (bench/bench_tree_vs_sglang.py, evict all)."""
    from tierkv.cache.config import CacheConfig
    from tierkv.cache.hicache import HiRadixCache
    from tierkv.pools.kv import DeviceKVPool
    from tierkv.pools.spec import KVSpec
    from tierkv.radix import RadixKey

    pool = DeviceKVPool(KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32), 128, 1, "cpu")
    cache = HiRadixCache(pool, CacheConfig(enable_host=False))
    cache.insert(RadixKey(list(range(32))), cache.alloc_device(32))
    # a second prompt sharing 16 tokens: the tree splits the first node and slices the new leaf
    assert cache.insert(RadixKey(list(range(16)) + list(range(100, 124))), cache.alloc_device(40)) == 40
    values = [n.device_value for n in cache.tree.nodes() if n.device_value is not None]
    assert len(values) == 3 and not any(v._is_view() for v in values)
    assert cache.evict(8) == 8  # the last victim is split (split_victims): its head stays, sliced plainly
    values = [n.device_value for n in cache.tree.nodes() if n.device_value is not None]
    assert sorted(len(v) for v in values) == [8, 16, 24] and not any(v._is_view() for v in values)
    cache.check_integrity()
