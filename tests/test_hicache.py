"""The two-tier cache: KV bytes survive L1 -> L2 -> L1, write policies, load back, eviction, counters."""

import threading

import pytest
import torch

from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, KVSpec
from tierkv.radix import RadixKey

SPECS = {
    "mha": dict(num_layers=2, kv_heads=2, head_dim=8),
    "mla": dict(num_layers=2, attention="mla", kv_lora_rank=12, rope_dim=4),
}


def make_cache(device_tokens=64, page_size=1, attention="mha", dtype=torch.float16, **cfg):
    spec = KVSpec(**SPECS[attention], dtype=dtype)
    pool = DeviceKVPool(spec, device_tokens, page_size, "cpu")
    return HiRadixCache(pool, CacheConfig(page_size=page_size, **cfg))


@pytest.fixture
def caches():
    made = []

    def factory(**kwargs):
        made.append(make_cache(**kwargs))
        return made[-1]

    yield factory
    for cache in made:
        cache.close()


def random_bits(pool, num_tokens, seed):
    """KV of random bit patterns (NaNs and infinities included): equality below is bit for bit."""
    s = pool.spec
    shape = (s.num_kv, s.num_layers, num_tokens, s.heads, s.dim * s.dtype.itemsize)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(s.dtype)


def put(cache, tokens, seed=0, extra_key=None):
    """Run a 'request': allocate slots, write its KV, insert it; returns the KV the tree now holds."""
    slots = cache.alloc_device(len(tokens) + (-len(tokens)) % cache.config.page_size)
    kv = random_bits(cache.device_pool, len(slots), seed)
    cache.device_pool.write_tokens(slots, kv)
    owned = cache.insert(RadixKey(tokens, extra_key), slots)
    if owned < len(slots):
        cache.device_pool.free(slots[owned:])
    return kv[:, :, :owned]


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def device_kv(cache, key):
    match = cache.match_prefix(key)
    return match, cache.device_pool.read_tokens(match.device_indices)


# ---- the bytes round trip --------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_kv_round_trip_l1_l2_l1_is_bit_exact(caches, attention, dtype, layout, io_backend, page_size,
                                             cpu_copy_impl):
    cache = caches(device_tokens=6 * page_size, page_size=page_size, attention=attention, dtype=dtype,
                   host_layout=layout, io_backend=io_backend, load_back_threshold=0)
    g = torch.Generator().manual_seed(page_size)
    tokens = torch.randint(0, 50_000, (3 * page_size + page_size // 2,), generator=g).tolist()
    kv = put(cache, tokens, seed=7)
    original_slots = cache.match_prefix(RadixKey(tokens)).device_indices
    cache.flush()  # the write-through to L2 completes
    assert cache.evict(cache.device_pool.num_slots) == 3 * page_size
    cache.device_pool.buffer.zero_()
    held = cache.device_pool.alloc(cache.device_pool.num_free_slots)
    others = held[~torch.isin(held, original_slots)][: 3 * page_size]
    cache.device_pool.free(others)  # only slots other than the originals are free for the load
    held = held[~torch.isin(held, others)]
    match = cache.match_prefix(RadixKey(tokens))
    assert len(match.device_indices) == 0 and match.host_hit_length == 3 * page_size
    load = cache.init_load_back(match.last_host_node)
    assert load.pending is not None and load.pending.wait()
    assert not set(load.device_indices.tolist()) & set(original_slots.tolist())
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
    cache.step()
    cache.check_integrity(caller_device_slots=held)


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_back_round_trip_is_bit_exact(caches, page_size):
    cache = caches(device_tokens=8 * page_size, page_size=page_size, write_policy="write_back",
                   load_back_threshold=0)
    tokens = list(range(5 * page_size))
    kv = put(cache, tokens, seed=3)
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots  # nothing copied at insert
    cache.evict(cache.device_pool.num_slots)
    held = cache.device_pool.alloc(3 * page_size)  # the load lands elsewhere than the originals
    load = cache.init_load_back(cache.match_prefix(RadixKey(tokens)).last_host_node)
    assert load.pending.wait()
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
    cache.step()
    cache.check_integrity(caller_device_slots=held)


# ---- write policies --------------------------------------------------------------------------------
def test_write_through_backs_up_on_first_insert(caches):
    cache = caches(write_policy="write_through", tier_mode="inclusive")
    put(cache, list(range(10)))
    node = cache.match_prefix(RadixKey(list(range(10)))).last_device_node
    assert node.host_value is not None and node.lock_ref == 1  # locked until the write is acked
    cache.flush()
    assert node.lock_ref == 0 and cache.stats.written_tokens == 10
    cache.check_integrity()


def test_write_through_selective_backs_up_on_the_second_hit(caches):
    cache = caches(write_policy="write_through_selective", tier_mode="inclusive")
    tokens = list(range(10))
    put(cache, tokens)
    cache.flush()
    node = cache.match_prefix(RadixKey(tokens)).last_device_node
    assert node.host_value is None and cache.stats.written_tokens == 0
    match = cache.match_prefix(RadixKey(tokens + [99]))
    cache.inc_lock_ref(match.last_device_node)
    slots = torch.cat([match.device_indices, cache.alloc_device(1)])
    cache.insert(RadixKey(tokens + [99]), slots)  # a follow-up request: the prefix is hit again
    cache.dec_lock_ref(match.last_device_node)
    cache.flush()
    assert node.host_value is not None and cache.stats.written_tokens == 10
    assert node.children and next(iter(node.children.values())).host_value is None  # hit once so far
    cache.check_integrity()


def test_write_back_copies_only_at_eviction(caches):
    cache = caches(write_policy="write_back")
    put(cache, list(range(10)))
    cache.flush()
    assert cache.stats.written_tokens == 0
    assert cache.evict(10) == 10
    assert cache.stats.written_tokens == 10
    match = cache.match_prefix(RadixKey(list(range(10))))
    assert match.host_hit_length == 10
    cache.check_integrity()


def test_write_back_evicts_whole_chains_and_keeps_the_host_tree_rooted(caches):
    cache = caches(write_policy="write_back")
    put(cache, list(range(4)), seed=1)
    put(cache, list(range(8)), seed=2)  # a child of the first
    assert cache.evict(8) == 8  # child, then its parent in the same call
    assert cache.device_pool.num_free_slots == cache.device_pool.num_slots
    cache.check_integrity()
    assert cache.match_prefix(RadixKey(list(range(8)))).host_hit_length == 8


def test_write_back_with_full_host_deletes_instead(caches):
    cache = caches(device_tokens=8, write_policy="write_back", hicache_ratio=1.5, tier_mode="inclusive")
    put(cache, list(range(8)))  # host: 12 tokens
    lock = cache.host_pool.alloc(8)  # someone else holds most of L2
    assert cache.evict(8) == 8
    assert cache.stats.write_skipped_tokens == 8 and list(cache.tree.nodes()) == []
    cache.check_integrity(caller_host_slots=lock)


def test_an_exclusive_demotion_into_a_short_l2_keeps_the_head_that_fits(caches):
    """Exclusive tiers rank a demoted node with L2's own: here it is L2's only candidate, so L2 drops its
    tail and keeps the 4 tokens it has room for, as one tier of the total would. Before, the whole node's
    copy was refused (write skipped) and all 8 tokens left the cache."""
    cache = caches(device_tokens=8, hicache_ratio=1.5, tier_mode="exclusive", load_chunk_tokens=0,
                   load_back_threshold=0)
    kv = put(cache, list(range(8)))  # host: 12 tokens
    lock = cache.host_pool.alloc(8)  # someone else holds most of L2
    assert cache.evict(8) == 8
    assert cache.device_pool.num_free_slots == 8 and cache.host_pool.num_free_slots == 0
    assert (cache.stats.written_tokens, cache.stats.write_skipped_tokens) == (4, 0)
    cache.check_integrity(caller_host_slots=lock)
    match = cache.match_prefix(RadixKey(list(range(8))))
    assert len(match.device_indices) == 0 and match.host_hit_length == 4
    load = cache.init_load_back(match.last_host_node)
    assert load.pending.wait() and load.loaded_tokens == 4
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv[:, :, :4])
    cache.step()
    cache.check_integrity(caller_host_slots=lock)


# ---- load back -------------------------------------------------------------------------------------
def _host_only(cache, tokens, seed=0):
    kv = put(cache, tokens, seed)
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    return kv


def test_load_back_threshold_skips_short_loads(caches):
    cache = caches(load_back_threshold=10)
    _host_only(cache, list(range(9)))
    match = cache.match_prefix(RadixKey(list(range(9))))
    load = cache.init_load_back(match.last_host_node)
    assert load.pending is None and load.loaded_tokens == 0 and len(load.device_indices) == 0
    assert cache.device_pool.num_free_slots == cache.device_pool.num_slots
    cache.check_integrity()


def test_mem_quota_skips_loads_over_it(caches):
    cache = caches(load_back_threshold=0)
    _host_only(cache, list(range(12)))
    node = cache.match_prefix(RadixKey(list(range(12)))).last_host_node
    assert cache.init_load_back(node, mem_quota=11).pending is None
    load = cache.init_load_back(node, mem_quota=12)
    assert load.pending.wait() and load.loaded_tokens == 12
    cache.step()
    cache.check_integrity()


def test_load_back_extends_a_device_prefix(caches):
    cache = caches(load_back_threshold=0, tier_mode="inclusive")
    kv_a = put(cache, list(range(6)), seed=1)
    kv_b = put(cache, list(range(10)), seed=2)
    cache.flush()
    leaf = cache.match_prefix(RadixKey(list(range(10)))).last_device_node
    cache.device_pool.free(cache.tree.clear_device_value(leaf))  # only the tail leaves L1
    match = cache.match_prefix(RadixKey(list(range(10))))
    assert len(match.device_indices) == 6 and match.host_hit_length == 4
    load = cache.init_load_back(match.last_host_node)
    assert load.loaded_tokens == 4 and len(load.device_indices) == 10 and load.pending.wait()
    got = cache.device_pool.read_tokens(load.device_indices)
    assert same_bits(got[:, :, :6], kv_a) and same_bits(got[:, :, 6:], kv_b[:, :, 6:])
    cache.step()
    cache.check_integrity()


def test_load_back_into_a_full_l1_evicts_first(caches):
    cache = caches(device_tokens=16, load_back_threshold=0)
    kv = _host_only(cache, list(range(12)), seed=4)
    put(cache, list(range(100, 116)), seed=5)
    cache.flush()  # L1 is full of an unlocked sequence
    assert cache.device_pool.num_free_slots == 0
    load = cache.init_load_back(cache.match_prefix(RadixKey(list(range(12)))).last_host_node)
    assert load.pending is not None and load.pending.wait()
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
    assert cache.stats.evicted_device_tokens >= 12 + 12
    cache.step()
    cache.check_integrity()


def test_load_back_is_all_or_nothing(caches):
    cache = caches(device_tokens=16, load_back_threshold=0)
    _host_only(cache, list(range(12)))
    put(cache, list(range(100, 108)))
    busy = cache.match_prefix(RadixKey(list(range(100, 108)))).last_device_node
    cache.inc_lock_ref(busy)  # a running request holds 8 of the 16 slots
    held = cache.device_pool.alloc(4)  # and a caller holds 4 more: 4 left, 12 needed
    match = cache.match_prefix(RadixKey(list(range(12))))
    load = cache.init_load_back(match.last_host_node)
    assert load.pending is None and len(load.device_indices) == 0
    assert all(n.device_value is None for n in cache.tree.path_to_root(match.last_host_node))
    assert cache.device_pool.num_free_slots == 4
    cache.check_integrity(caller_device_slots=held)
    cache.dec_lock_ref(busy)


def test_loaded_nodes_stay_locked_until_the_load_is_acknowledged(caches):
    cache = caches(load_back_threshold=0)
    kv = _host_only(cache, list(range(12)), seed=6)
    gate = threading.Event()
    cache.transfer.delay_hook = lambda kind: gate.wait(5)
    load = cache.init_load_back(cache.match_prefix(RadixKey(list(range(12)))).last_host_node)
    assert load.last_node.lock_ref == 1 and cache.protected_size == 12
    assert cache.evict(12) == 0  # the loading node is not evictable
    assert cache.evict_host(12) == 0  # nor are its host slots
    cache.step()
    assert load.last_node.lock_ref == 1  # the copy has not finished: still locked after a step
    gate.set()
    assert load.pending.wait()
    cache.step()
    assert load.last_node.lock_ref == 0 and cache.evictable_size == 12
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
    cache.check_integrity()


def test_a_device_hit_on_a_load_in_flight_waits_for_its_kv(caches):
    cache = caches(load_back_threshold=0)
    kv = _host_only(cache, list(range(12)), seed=7)
    gate = threading.Event()
    cache.transfer.delay_hook = lambda kind: gate.wait(0.3)  # the copy lands only after the gate times out
    cache.init_load_back(cache.match_prefix(RadixKey(list(range(12)))).last_host_node)
    match = cache.match_prefix(RadixKey(list(range(12))))  # another request: now an L1 hit
    assert len(match.device_indices) == 12
    assert same_bits(cache.device_pool.read_tokens(match.device_indices), kv)
    cache.step()
    cache.check_integrity()


def test_load_back_under_write_back_keeps_the_host_path_it_loads(caches):
    """Making room in L1 may write back and so evict from L2: never the nodes being loaded."""
    cache = caches(device_tokens=16, write_policy="write_back", hicache_ratio=2.0, load_back_threshold=0)
    kv = put(cache, list(range(8)), seed=8)
    cache.evict(16)  # A: host-only, oldest
    put(cache, list(range(200, 216)), seed=9)
    cache.evict(16)  # C: host-only; L2 holds 24 of 32
    put(cache, list(range(100, 116)), seed=10)  # B fills L1, not backed up
    match = cache.match_prefix(RadixKey(list(range(8))))
    cache.match_prefix(RadixKey(list(range(200, 216))))  # A is now L2's least recently used
    load = cache.init_load_back(match.last_host_node)
    cache.check_integrity()
    if load.pending is not None:
        assert load.pending.wait()
        assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
    cache.step()
    cache.check_integrity()


# ---- L2 pressure -----------------------------------------------------------------------------------
@pytest.mark.parametrize("split_victims", [False, True])
def test_full_l2_evicts_from_l2_before_writing(caches, split_victims):
    cache = caches(device_tokens=16, hicache_ratio=2.0, split_victims=split_victims)  # host: 32 tokens
    for i in range(3):
        _host_only(cache, list(range(100 * i, 100 * i + 12)), seed=i)
    # the third write needed 4 more slots: a whole node goes, or only its last 4 tokens
    assert cache.stats.evicted_host_tokens == (4 if split_victims else 12)
    assert cache.host_pool.allocator.num_used_slots <= 32
    # the LRU victim: gone, or its first 8 tokens left in L2
    assert cache.match_prefix(RadixKey(list(range(12)))).host_hit_length == (8 if split_victims else 0)
    assert cache.match_prefix(RadixKey(list(range(200, 212)))).host_hit_length == 12
    cache.check_integrity()


def test_write_stays_l1_only_when_l2_cannot_make_room(caches):
    cache = caches(device_tokens=16, hicache_ratio=2.0, tier_mode="inclusive")
    held = cache.host_pool.alloc(28)  # L2 space nobody can evict
    put(cache, list(range(8)))
    cache.flush()
    node = cache.match_prefix(RadixKey(list(range(8)))).last_device_node
    assert node.host_value is None and cache.stats.write_skipped_tokens == 8
    assert cache.evict(8) == 8 and list(cache.tree.nodes()) == []  # not backed up: deleted
    cache.check_integrity(caller_host_slots=held)


def test_evict_host_drops_backups_of_l1_nodes_and_deletes_host_only_ones(caches):
    cache = caches(device_tokens=32, tier_mode="inclusive")
    _host_only(cache, list(range(8)), seed=1)
    put(cache, list(range(50, 58)), seed=2)
    cache.flush()
    assert cache.evict_host(64) == 16
    assert cache.match_prefix(RadixKey(list(range(8)))).host_hit_length == 0
    match = cache.match_prefix(RadixKey(list(range(50, 58))))
    assert len(match.device_indices) == 8 and match.last_device_node.host_value is None
    cache.check_integrity()


# ---- eviction accounting ---------------------------------------------------------------------------
@pytest.mark.parametrize("split_victims", [False, True])
def test_evict_frees_what_it_needs_and_skips_locked_ones(caches, split_victims):
    cache = caches(device_tokens=64, split_victims=split_victims)
    kv = put(cache, list(range(10)), seed=1)
    put(cache, list(range(20, 30)), seed=2)
    cache.flush()
    locked = cache.match_prefix(RadixKey(list(range(20, 30)))).last_device_node
    cache.inc_lock_ref(locked)
    left = 7 if split_victims else 0  # the victim's first 7 tokens stay, or node granularity (HiCache)
    assert cache.evict(3) == 10 - left
    assert len(cache.match_prefix(RadixKey(list(range(10)))).device_indices) == left
    if left:  # the head kept its KV and its rank: it goes next
        assert same_bits(cache.device_pool.read_tokens(
            cache.match_prefix(RadixKey(list(range(10)))).device_indices), kv[:, :, :left])
    assert cache.evict(100) == left  # the rest is locked
    assert cache.evictable_size == 0 and cache.protected_size == 10
    cache.dec_lock_ref(locked)
    cache.check_integrity()


def test_insert_frees_slots_duplicating_cached_kv(caches):
    cache = caches(device_tokens=32)
    kv = put(cache, list(range(10)), seed=1)
    free_before = cache.device_pool.num_free_slots
    slots = cache.device_pool.alloc(12)
    assert cache.insert(RadixKey(list(range(12))), slots) == 12
    assert cache.device_pool.num_free_slots == free_before - 2  # the 10 duplicate slots went back
    match = cache.match_prefix(RadixKey(list(range(12))))
    assert same_bits(cache.device_pool.read_tokens(match.device_indices[:10]), kv)
    cache.flush()
    cache.check_integrity()


def test_extra_keys_are_separate_caches(caches):
    cache = caches()
    kv_a = put(cache, list(range(8)), seed=1, extra_key="lora-a")
    kv_b = put(cache, list(range(8)), seed=2, extra_key="lora-b")
    _, got_a = device_kv(cache, RadixKey(list(range(8)), "lora-a"))
    _, got_b = device_kv(cache, RadixKey(list(range(8)), "lora-b"))
    assert same_bits(got_a, kv_a) and same_bits(got_b, kv_b)
    assert len(cache.match_prefix(RadixKey(list(range(8)))).device_indices) == 0


def test_bigram_cache_round_trip(caches):
    cache = caches(bigram=True, load_back_threshold=0)
    tokens = list(range(9))
    kv = _host_only(cache, tokens, seed=3)  # 8 pairs
    load = cache.init_load_back(cache.match_prefix(RadixKey(tokens)).last_host_node)
    assert load.pending.wait() and len(load.device_indices) == 8
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
    cache.step()
    cache.check_integrity()


# ---- reset, counters, L1-only ----------------------------------------------------------------------
def test_stats_count_hits_evictions_writes_and_loads(caches):
    cache = caches(load_back_threshold=0, tier_mode="inclusive")
    _host_only(cache, list(range(10)))
    put(cache, list(range(50, 56)))
    cache.flush()
    cache.match_prefix(RadixKey(list(range(50, 56))))
    load = cache.init_load_back(cache.match_prefix(RadixKey(list(range(10)))).last_host_node)
    load.pending.wait()
    cache.step()
    s = cache.stats
    assert s.device_hit_tokens == 6 and s.host_hit_tokens == 10
    assert s.written_tokens == 16 and s.loaded_tokens == 10 and s.evicted_device_tokens == 10
    assert cache.evict_host(100) == 16 and cache.stats.evicted_host_tokens == 16


def test_reset_drops_everything(caches):
    cache = caches()
    put(cache, list(range(10)))
    _host_only(cache, list(range(20, 30)))
    cache.reset()
    assert list(cache.tree.nodes()) == []
    assert cache.device_pool.num_free_slots == cache.device_pool.num_slots
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
    assert cache.stats.written_tokens == 0
    assert cache.match_prefix(RadixKey(list(range(10)))).host_hit_length == 0
    cache.check_integrity()


def test_l1_only_cache_deletes_on_eviction(caches):
    cache = caches(enable_host=False)
    assert cache.host_pool is None and cache.transfer is None
    put(cache, list(range(10)))
    assert cache.evict(10) == 10 and list(cache.tree.nodes()) == []
    cache.check_integrity()


# ---- the cache's integrity check really checks -------------------------------------------------------
@pytest.mark.parametrize("how", ["leak", "double_owner", "freed_but_owned", "host_leak", "misaligned"])
def test_check_integrity_catches_slot_ownership_errors(caches, how):
    cache = caches(page_size=2, device_tokens=32)
    put(cache, list(range(8)))
    put(cache, list(range(20, 28)))
    cache.flush()
    cache.check_integrity()
    nodes = sorted(cache.tree.nodes(), key=lambda n: n.id)
    if how == "leak":
        cache.device_pool.alloc(2)
    elif how == "double_owner":
        nodes[1].device_value = nodes[0].device_value.clone()
    elif how == "freed_but_owned":
        cache.device_pool.free(nodes[0].device_value)
    elif how == "host_leak":
        cache.host_pool.alloc(2)
    elif how == "misaligned":
        nodes[0].device_value = nodes[0].device_value.roll(1)
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_failed_write_back_deletes_instead_of_keeping_bad_kv(caches):
    cache = caches(write_policy="write_back")
    put(cache, list(range(4)), seed=1)
    put(cache, list(range(8)), seed=2)
    cache.transfer.write_now = lambda device_slots, host_slots: OSError("injected")
    assert cache.evict(8) == 8
    assert list(cache.tree.nodes()) == [] and cache.stats.failed_copies == 1
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
    cache.check_integrity()


def test_failed_write_back_of_a_leaf_keeps_its_ancestors_in_l1(caches):
    cache = caches(split_victims=False, write_policy="write_back")
    kv = put(cache, list(range(4)), seed=1)
    put(cache, list(range(8)), seed=2)
    cache.transfer.write_now = lambda device_slots, host_slots: OSError("injected")
    assert cache.evict(1) == 4  # only the leaf: its parent was to be backed up with it, not evicted
    match = cache.match_prefix(RadixKey(list(range(8))))
    assert len(match.device_indices) == 4 and match.host_hit_length == 0
    assert same_bits(cache.device_pool.read_tokens(match.device_indices), kv)
    cache.check_integrity()


# ---- L2 need not be a rooted subtree (HiCache's write-back: only the evicted node is copied) ----------
def test_write_back_copies_only_the_evicted_leaf_not_its_l1_parent(caches):
    cache = caches(split_victims=False, write_policy="write_back")
    put(cache, list(range(8)), seed=1)
    put(cache, list(range(12)), seed=2)  # a 4-token leaf under the 8-token parent
    assert cache.evict(1) == 4  # the leaf only
    assert cache.stats.written_tokens == 4  # not 12: the parent, still in L1, is copied when evicted
    parent = cache.match_prefix(RadixKey(list(range(8)))).last_device_node
    assert parent.device_value is not None and parent.host_value is None
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots - 4
    cache.check_integrity()
    assert cache.evict(1) == 8  # now the parent: copied in turn
    assert cache.stats.written_tokens == 12
    assert cache.match_prefix(RadixKey(list(range(12)))).host_hit_length == 12
    cache.check_integrity()


def test_load_back_through_an_l1_resident_parent(caches):
    cache = caches(split_victims=False, write_policy="write_back", load_back_threshold=0)
    parent_kv = put(cache, list(range(8)), seed=1)
    leaf_kv = put(cache, list(range(12)), seed=2)[:, :, 8:]  # its first 8 slots duplicated the parent's
    cache.evict(1)
    match = cache.match_prefix(RadixKey(list(range(12))))
    assert len(match.device_indices) == 8 and match.host_hit_length == 4
    assert match.last_host_node.parent.host_value is None  # the parent is only in L1
    load = cache.init_load_back(match.last_host_node)
    assert load.pending.wait() and load.loaded_tokens == 4
    assert same_bits(cache.device_pool.read_tokens(load.device_indices), torch.cat([parent_kv, leaf_kv], dim=2))
    cache.step()
    cache.check_integrity()


def test_failed_write_back_of_a_parent_removes_its_l2_only_children(caches):
    """The parent's copy fails: nothing leads to the child's L2 copy any more, so it goes too."""
    cache = caches(split_victims=False, write_policy="write_back")
    put(cache, list(range(8)), seed=1)
    put(cache, list(range(12)), seed=2)
    cache.evict(1)  # the leaf goes to L2, under its L1-only parent
    cache.transfer.write_now = lambda device_slots, host_slots: OSError("injected")
    assert cache.evict(1) == 8
    assert list(cache.tree.nodes()) == [] and cache.stats.failed_copies == 1
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots  # the child's slots too
    assert cache.device_pool.num_free_slots == cache.device_pool.num_slots
    cache.check_integrity()


def test_parent_refused_by_admission_takes_its_l2_only_children_with_it(caches):
    """l2_admission admits the leaf, not its parent: L1 evicting the parent deletes both. (A split
    parent has had its child's uses and more, so the policy here is told whom to admit; tinylfu's
    remembered frequency can rank a re-created child above its parent.)"""
    cache = caches(split_victims=False, write_policy="write_back", eviction_policy="lru", l2_admission=True)
    put(cache, list(range(12)), seed=1)
    put(cache, list(range(8)) + [100, 101], seed=2)  # splits it under an 8-token parent
    leaf = cache.tree.match(RadixKey(list(range(12))), touch=False).last_node
    parent = leaf.parent
    assert len(leaf) == 4 and len(parent) == 8
    cache.priority.admit = lambda node: node is leaf
    assert cache.evict(2) == 4  # LRU: the 4-token leaf, written back
    assert leaf.host_value is not None and leaf.device_value is None and parent.host_value is None
    assert cache.evict(3) == 10  # the other leaf, then the parent: refused, it goes with its L2-only child
    assert list(cache.tree.nodes()) == []
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
    assert cache.stats.evicted_host_tokens == 4
    cache.check_integrity()


# ---- exclusive tiers: a finished load frees its L2 copies before L1 demotes for more room -------------
def test_exclusive_alloc_promotes_a_finished_load_before_l2_evicts_for_demotions(caches):
    cache = caches(device_tokens=16, hicache_ratio=2.0, tier_mode="exclusive", load_back_threshold=0,
                   load_chunk_tokens=0)  # one asynchronous load
    kv_a = put(cache, list(range(8)), seed=1)
    put(cache, list(range(100, 108)), seed=2)
    put(cache, list(range(200, 208)), seed=3)  # demotes A: L1 holds B and C, L2 holds A
    put(cache, list(range(300, 308)), seed=4)
    put(cache, list(range(400, 408)), seed=5)
    put(cache, list(range(500, 508)), seed=6)  # L2 (32 slots) now holds A, B, C and D
    assert cache.host_pool.num_free_slots == 0
    match = cache.match_prefix(RadixKey(list(range(8))))
    load = cache.init_load_back(match.last_host_node)  # L2 evicts for the demotions: A's copy still counts
    assert load.pending.wait() and same_bits(cache.device_pool.read_tokens(load.device_indices), kv_a)
    evicted_before = cache.stats.evicted_host_tokens
    cache.inc_lock_ref(load.last_node)
    slots = cache.alloc_device(8)  # the load is done, not yet retired: its promotion frees A's 8 L2 slots
    cache.dec_lock_ref(load.last_node)
    assert slots is not None
    assert cache.stats.evicted_host_tokens == evicted_before  # the demotion took A's slots, L2 lost nothing
    assert cache.match_prefix(RadixKey(list(range(8)))).host_hit_length == 0  # A: in L1 only
    cache.device_pool.free(slots)
    cache.check_integrity()


def test_split_victims_rejects_a_non_bool(caches):
    with pytest.raises(ValueError, match="split_victims"):
        CacheConfig(split_victims=1)
