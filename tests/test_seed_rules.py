"""HiCache's rules where tierkv once deviated: hit counting (write_back, chunked inserts, revived
nodes), the load-back quota's delta, what ``last_host_node`` promises, what a finished prefetch refreshes
and keeps, and LFU under write_back."""

from __future__ import annotations

import pytest
import torch

from tierkv.radix import RadixKey

from storage_util import attach_fake, compute_and_insert, load_hit, make_cache, random_tokens

PS = 16


def _path_hits(cache, key: RadixKey) -> list[int]:
    return [n.hit_count for n in cache.tree.match(key, touch=False).nodes]


def test_a_prompt_prefilled_in_two_chunks_counts_one_hit():
    # backup to L2 at the 2nd hit
    cache = make_cache(page_size=PS, write_policy="write_through_selective", tier_mode="inclusive")
    key = RadixKey(random_tokens(4 * PS, seed=61))
    slots = cache.alloc_device(4 * PS)
    cache.insert(RadixKey(key.token_ids[: 2 * PS]), slots[: 2 * PS], chunked=True)  # the first chunk
    owned = cache.insert(key, slots)  # the whole prompt, once prefilled
    assert owned == 4 * PS
    cache.flush()
    assert _path_hits(cache, key) == [1, 1]
    assert cache.stats.written_tokens == 0  # one request: nothing is hot enough for L2 yet
    cache.check_integrity()
    cache.close()


def test_write_back_counts_no_hits():
    cache = make_cache(page_size=PS, write_policy="write_back")
    key = RadixKey(random_tokens(2 * PS, seed=62))
    compute_and_insert(cache, key, seed=63)
    compute_and_insert(cache, key, seed=63)
    assert _path_hits(cache, key) == [0]
    cache.close()


def test_a_revived_node_is_not_counted():
    cache = make_cache(page_size=PS, write_policy="write_through", tier_mode="inclusive")
    key = RadixKey(random_tokens(2 * PS, seed=64))
    kv = compute_and_insert(cache, key, seed=65)
    cache.flush()
    cache.evict(cache.device_pool.num_slots)  # host-only now
    assert cache.match_prefix(key).host_hit_length == 2 * PS
    compute_and_insert(cache, key, seed=0, kv=kv)  # recomputed: the host-only node gets device slots back
    assert _path_hits(cache, key) == [1]
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("mem_quota,loads", [(40, False), (64, True)])
def test_load_back_quota_counts_tokens_the_lock_makes_unevictable(mem_quota: int, loads: bool):
    cache = make_cache(page_size=PS, write_policy="write_through", load_back_threshold=1)
    key = RadixKey(random_tokens(4 * PS, seed=66))
    kv = compute_and_insert(cache, key, seed=67)
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=0, kv=kv[:, :, : 2 * PS])
    m = cache.match_prefix(key)
    assert len(m.device_indices) == 2 * PS and m.host_hit_length == 2 * PS
    # 32 tokens to load; locking the path makes the 32-token device prefix unevictable
    result = cache.init_load_back(m.last_host_node, mem_quota=mem_quota)
    assert (result.pending is not None) == loads
    if result.pending is not None:
        assert result.pending.wait()
        assert result.loaded_tokens == 2 * PS  # the host-only half was loaded
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_last_host_node_is_the_deepest_match_whatever_tier_holds_it():
    cache = make_cache(page_size=PS, write_policy="write_back")
    key = RadixKey(random_tokens(3 * PS, seed=68))
    compute_and_insert(cache, key, seed=69)
    m = cache.match_prefix(key)
    assert m.last_host_node is m.last_device_node  # L1 only: HiCache would return the root here
    assert m.last_host_node.host_value is None and m.host_hit_length == 0
    cache.evict(cache.device_pool.num_slots)  # write_back copies to L2 first
    m = cache.match_prefix(key)
    assert m.last_host_node.host_value is not None and m.host_hit_length == 3 * PS
    cache.close()


@pytest.mark.parametrize("policy", ["lfu", "slru"])
@pytest.mark.parametrize("write_policy, evicted", [("write_back", "a"), ("write_through", "b")])
def test_lfu_and_slru_stay_lru_ordered_under_write_back(policy: str, write_policy: str, evicted: str):
    """a is inserted three times, then b once: under write_back no use is counted (HiCache's hit_count),
    so a, used longest ago, goes first; under write_through b, used once, goes first."""
    cache = make_cache(page_size=PS, write_policy=write_policy, eviction_policy=policy, tier_mode="inclusive")
    keys = {name: RadixKey(random_tokens(2 * PS, seed=70 + i)) for i, name in enumerate("ab")}
    for name in "aaab":
        compute_and_insert(cache, keys[name], seed=71)
    cache.flush()
    cache.evict(2 * PS)
    cache.flush()
    gone = [name for name, key in keys.items() if len(cache.match_prefix(key).device_indices) == 0]
    assert gone == [evicted]
    cache.check_integrity()
    cache.close()


def _in_l3(key: RadixKey, seed: int) -> tuple[dict, object]:
    """A store holding all of ``key``'s pages (written through by another cache), and their KV."""
    writer = make_cache(page_size=PS, write_policy="write_through")
    blobs: dict = {}
    attach_fake(writer, blobs)
    kv = compute_and_insert(writer, key, seed=seed)
    writer.flush()
    writer.close()
    return blobs, kv


def _prefetch(cache, key: RadixKey, m=None) -> None:
    m = m or cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress("r")


def test_a_finished_prefetch_refreshes_the_anchor_not_its_ancestors():
    """A (2 pages) and B (2 pages under A) in L1 and L2, C only in L3: the prefetch anchors at B; its
    insert walk refreshes B, as HiCache's insert_host touches the node it starts from, but not A."""
    key = RadixKey(random_tokens(6 * PS, seed=72))
    blobs, kv = _in_l3(key, seed=73)
    cache = make_cache(page_size=PS, write_policy="write_through", tier_mode="inclusive")
    attach_fake(cache, blobs)
    for num_pages in (2, 4):
        compute_and_insert(cache, RadixKey(key.token_ids[: num_pages * PS]), seed=0, kv=kv[:, :, : num_pages * PS])
    cache.flush()
    m = cache.match_prefix(key)
    a, b = cache.tree.match(key, touch=False).nodes
    assert len(a) == len(b) == 2 * PS and b.host_value is not None and m.last_host_node is b
    matched_at = b.last_access_time
    assert a.last_access_time == matched_at
    _prefetch(cache, key, m)
    assert b.last_access_time > matched_at and a.last_access_time == matched_at
    cache.check_integrity()
    cache.close()


def _prefetched_through_an_l1_prefix(seed: int, **config):
    """A prefetch of 6 pages from L3 into an empty cache (the root its anchor), during which another
    request computes the first 2 into L1 only; (cache, key, KV of the key) once it has ended."""
    key = RadixKey(random_tokens(6 * PS, seed=seed))
    blobs, kv = _in_l3(key, seed=seed + 1)
    cache = make_cache(page_size=PS, **config)
    attach_fake(cache, blobs)
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=0, kv=kv[:, :, : 2 * PS])
    cache.flush()
    assert cache.check_prefetch_progress("r")
    return cache, key, kv


def test_fetched_pages_of_a_device_only_node_are_freed_as_hicache():
    """write_back keeps the recomputed prefix L1-only: the fetched pages of that prefix are freed (the
    node keeps no L2 copy from the prefetch), the rest hangs below it as host-only."""
    cache, key, kv = _prefetched_through_an_l1_prefix(74, write_policy="write_back")
    head, tail = cache.tree.match(key, touch=False).nodes
    assert head.host_value is None and head.device_value is not None
    assert tail.host_value is not None and len(tail) == 4 * PS
    assert cache.host_pool.num_slots - cache.host_pool.num_free_slots == 4 * PS
    cache.check_integrity()
    assert torch.equal(load_hit(cache, key), kv)
    cache.close()


def test_exclusive_tiers_hold_no_fetched_page_twice():
    """Exclusive tiers: an L1 node never has an L2 copy, so a prefetch through it must not give it one."""
    cache, key, kv = _prefetched_through_an_l1_prefix(76, tier_mode="exclusive")
    assert not [n for n in cache.tree.nodes() if n.device_value is not None and n.host_value is not None]
    cache.check_integrity()
    assert torch.equal(load_hit(cache, key), kv)
    cache.close()
