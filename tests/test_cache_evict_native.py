"""HiRadixCache.evict and evict_host run the heap's compiled loop (EvictionHeap.evict_device_until_held,
evict_host_until_held) and hand the victims that need the cache (split, deleted with L2-only descendants,
kept for a host_ref) to Python: the same victims, tree and pools as the pure-Python loop, request by
request."""

import random

import pytest
import torch

from tierkv.cache.config import CacheConfig
from tierkv.eviction import heap as heap_module
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool, KVSpec
from tierkv.radix import RadixKey

SPEC = KVSpec(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32)


def state(cache):
    nodes = sorted((tuple(cache.tree.path_to_root(n)[0].key[:4]), len(n), n.device_value is not None,
                    n.host_value is not None, n.last_access_time) for n in cache.tree.nodes())
    remembered = sorted(cache.priority._uses.values())  # the policy forgot the removed nodes' uses
    return (nodes, cache.device_pool.num_free_slots, cache.host_pool.num_free_slots,
            cache.stats.evicted_device_tokens, remembered)


def serve(cache, rng, page_size):
    """One request as the replay serves it, with occasional evictions of random sizes."""
    base = rng.choice([list(range(40)), list(range(100, 170)), list(range(500, 520))])
    ids = base + [rng.randrange(1000, 1010) for _ in range(rng.randrange(0, 40))]
    key = RadixKey(ids)
    match = cache.match_prefix(key)
    load = cache.init_load_back(match.last_host_node)
    prefix, last = match.device_indices, match.last_device_node
    if load.loaded_tokens:
        prefix, last = load.device_indices, load.last_node
    if load.pending is not None:
        load.pending.wait()
    num_new = -(-(len(ids) - len(prefix)) // page_size) * page_size
    cache.inc_lock_ref(last)  # as the replay: the prefix stays while allocating evicts
    slots = cache.alloc_device(num_new) if num_new else prefix[:0]
    if slots is not None:
        owned = cache.insert(key, torch.cat([prefix, slots]))
        cache.device_pool.free(torch.cat([prefix, slots])[owned:])
    cache.dec_lock_ref(last)
    cache.flush()
    if rng.random() < 0.3:
        return cache.evict(rng.randrange(1, 60))
    return None


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("split_victims", [True, False])
@pytest.mark.parametrize("write_policy,policy", [("write_through", "lru"), ("write_through_selective", "lru"),
                                                 ("write_through", "gdsf")])
def test_compiled_cache_eviction_matches_the_python_loop(monkeypatch, page_size, split_victims, write_policy,
                                                         policy):
    if heap_module.native_evict_device is None:
        pytest.skip("the compiled eviction loop is not built")
    config = CacheConfig(page_size=page_size, split_victims=split_victims, write_policy=write_policy,
                         eviction_policy=policy, hicache_ratio=1.5, overlap_cpu_writes=False)
    caches = [HiRadixCache(DeviceKVPool(SPEC, 160, page_size, "cpu"), config) for _ in range(2)]
    native = heap_module.native_evict_device
    rngs = [random.Random(7), random.Random(7)]
    for _ in range(300):
        freed = []
        for cache, rng, impl in zip(caches, rngs, (native, None)):
            monkeypatch.setattr(heap_module, "native_evict_device", impl)
            freed.append(serve(cache, rng, page_size))
            cache.check_integrity()
        assert freed[0] == freed[1]
        assert state(caches[0]) == state(caches[1])
    assert caches[0].stats.evicted_device_tokens > 0
    if write_policy == "write_through":  # backs up enough to fill L2
        assert caches[0].stats.evicted_host_tokens > 0
    for cache in caches:
        cache.close()


@pytest.mark.parametrize("native", [True, False])
def test_the_loop_hands_back_victims_the_cache_must_evict(monkeypatch, native):
    """A victim with no L2 copy but an L2-only child, one with a host_ref, and (split) one longer than
    needed are handed back, popped but not evicted; others are evicted in the loop."""
    from tierkv.eviction import get_policy
    from tierkv.eviction.heap import EvictionHeap
    from tierkv.radix import RadixTree

    if native and heap_module.native_evict_device is None:
        pytest.skip("the compiled eviction loop is not built")
    if not native:
        monkeypatch.setattr(heap_module, "native_evict_device", None)
    tree = RadixTree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    plain = tree.insert(RadixKey([1, 2]), [10, 11]).new_node
    parent = tree.insert(RadixKey([5, 6]), [12, 13]).new_node
    child = tree.add_leaf(parent, [7], None)
    child.host_value = [0]
    held_ref = tree.insert(RadixKey([8, 9, 3, 4]), [14, 15, 16, 17]).new_node
    freed, values, held = heap.evict_device_until_held(100, None, split=False)
    assert (freed, values, held) == (2, [[10, 11]], parent)  # oldest first; parent has an L2-only child
    assert plain.parent is None or plain not in tree.root.children.values()
    tree.mark_changed("device", [parent])
    tree.inc_host_ref(held_ref)
    parent.host_value = [1, 2]  # backed up now: evicted in the loop, kept as host-only
    freed, values, held = heap.evict_device_until_held(100, None, split=False)
    assert (freed, values, held) == (2, [[12, 13]], held_ref)
    tree.dec_host_ref(held_ref)
    tree.mark_changed("device", [held_ref])
    assert heap.evict_device_until_held(2, None, split=True) == (0, [], held_ref)  # 4 tokens, 2 needed
    tree.mark_changed("device", [held_ref])
    assert heap.evict_device_until_held(4, None, split=True) == (4, [[14, 15, 16, 17]], None)
