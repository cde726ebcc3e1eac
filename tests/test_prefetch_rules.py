"""HiCache's prefetch rules: revoke under the threshold, a budget sized by what L3 holds, the default
rate limit, and prefetched tokens counting only what was new to the tree."""

from __future__ import annotations

import time

import pytest

from tierkv.radix import RadixKey

from storage_util import (FakeStore, attach_fake, compute_and_insert, drop_l1_l2, make_cache, random_tokens,
                          storage_config)

PS = 16


def _cache_with_stored(num_pages: int, stored_pages: int, **storage):
    """A cache whose L3 holds the first ``stored_pages`` of a ``num_pages`` key; L1 and L2 empty."""
    cache = make_cache(page_size=PS, device_tokens=num_pages * PS * 2, tier_mode="inclusive")
    store = attach_fake(cache, **storage)
    key = RadixKey(random_tokens(num_pages * PS, seed=41))
    compute_and_insert(cache, key, seed=42)
    drop_l1_l2(cache)
    for stored in list(store.blobs)[stored_pages:]:
        del store.blobs[stored]
    store.calls.clear()
    return cache, store, key


def test_prefetch_revoked_when_l3_holds_less_than_the_threshold():
    cache, store, key = _cache_with_stored(8, 1, prefetch_threshold=4 * PS)
    assert cache.prefetch_from_storage("r", cache.tree.root, key)  # 8 pages beyond L2: worth asking
    cache.flush()
    assert cache.check_prefetch_progress("r")
    assert cache.storage.stats.prefetch_revoked == 1
    assert "get" not in store.calls  # 1 page found < the 4-page threshold: nothing read
    assert cache.match_prefix(key).host_hit_length == 0
    assert cache.host_pool.allocator.num_free_slots == cache.host_pool.num_slots
    cache.check_integrity()
    cache.close()


def test_timeout_budget_grows_with_the_pages_l3_holds():
    base_s, per_ki_s = 0.5, 64.0
    cache, store, key = _cache_with_stored(64, 1, prefetch_stop_policy="timeout", prefetch_timeout_base=base_s,
                                           prefetch_timeout_per_ki_token=per_ki_s, prefetch_batch_pages=1)
    store.hang.clear()  # exists passes below; reads block, so only the budget can end the prefetch
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    prefetch = cache.storage.prefetches["r"]
    store.hang.set()
    prefetch.finished.wait(5.0)
    # L3 holds 1 page: the budget is base + 1 page's share (0.5 s + 1 s), not base + 64 pages' (64.5 s)
    cache.step()
    assert prefetch.budget_s == pytest.approx(base_s + per_ki_s * PS / 1024)
    cache.close()


def test_a_timed_out_prefetch_stops_after_the_budget_of_what_l3_holds():
    cache, store, key = _cache_with_stored(64, 4, prefetch_stop_policy="timeout", prefetch_timeout_base=0.5,
                                           prefetch_timeout_per_ki_token=64.0, prefetch_batch_pages=1)
    store.corrupt = set(store.blobs)  # reads return nothing useful: only the budget ends it
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    prefetch = cache.storage.prefetches["r"]
    assert prefetch.exists_done.wait(5.0)
    cache.step()  # agrees on the 4 pages L3 holds
    prefetch.started_s = time.monotonic() - (0.5 + 4 * 1.0 + 0.1)  # as if 4.6 s had passed
    cache.step()
    assert cache.check_prefetch_progress("r"), "4 pages' budget (4.5 s) has passed; 64 pages' would not"
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_default_rate_limit_is_four_fifths_of_l2_beyond_l1():
    cache = make_cache(page_size=PS, device_tokens=512, hicache_ratio=3.0)
    attach_fake(cache)
    # L2 is the host pool less the staging it keeps for exclusive chunked loads (which counted as room before)
    room = cache.host_pool.num_slots - cache.config.staging_tokens - cache.device_pool.num_slots
    assert cache.config.staging_tokens == 256 and cache.storage.max_tokens_in_flight == int(0.8 * room)
    cache.close()
    cache = make_cache(page_size=PS, device_tokens=512)
    attach_fake(cache, prefetch_max_tokens_in_flight=64)
    assert cache.storage.max_tokens_in_flight == 64
    cache.close()


def test_prefetched_tokens_exclude_pages_the_tree_already_had():
    cache, store, key = _cache_with_stored(4, 4, prefetch_stop_policy="wait_complete",
                                           prefetch_max_tokens_in_flight=1024)
    assert cache.prefetch_from_storage("a", cache.tree.root, key)
    assert cache.prefetch_from_storage("b", cache.tree.root, key)  # the same prompt, twice in flight
    cache.flush()
    assert cache.check_prefetch_progress("a") and cache.check_prefetch_progress("b")
    assert cache.storage.stats.prefetched_tokens == 4 * PS  # "b" brought nothing new
    assert cache.stats.storage_hit_tokens == 4 * PS
    cache.check_integrity()
    cache.close()


class _PrefixKeyStore(FakeStore):
    """A store that wants the hashes before each batch (as SGLang's hf3fs backend does)."""

    accepts_prefix_keys = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, list[str], list[str] | None]] = []

    def batch_exists(self, keys, prefix_keys=None):
        self.seen.append(("exists", list(keys), prefix_keys))
        return super().batch_exists(keys)

    def batch_get(self, keys, targets, prefix_keys=None):
        self.seen.append(("get", list(keys), prefix_keys))
        return super().batch_get(keys, targets)

    def batch_set(self, keys, values, prefix_keys=None):
        self.seen.append(("set", list(keys), prefix_keys))
        return super().batch_set(keys, values)


@pytest.mark.parametrize("pass_prefix_keys", [True, False])
def test_prefix_keys_reach_stores_that_want_them(pass_prefix_keys: bool):
    cache = make_cache(page_size=PS, device_tokens=512, load_back_threshold=1)
    store = _PrefixKeyStore("ns", cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_batch_pages=2, backup_batch_pages=2,
                                               prefetch_stop_policy="wait_complete",
                                               hicache_storage_pass_prefix_keys=pass_prefix_keys), "test-model")
    key = RadixKey(random_tokens(6 * PS, seed=81))
    kv = compute_and_insert(cache, key, seed=82)
    cache.flush()
    hashes = list(store.blobs)
    sets = [(keys, prefix) for op, keys, prefix in store.seen if op == "set"]
    want = [(hashes[0:2], []), (hashes[2:4], hashes[:2]), (hashes[4:6], hashes[:4])]
    assert sets == (want if pass_prefix_keys else [(k, None) for k, _ in want])
    drop_l1_l2(cache)
    compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=0, kv=kv[:, :, : 2 * PS])
    cache.flush()  # the first 2 pages are in L1 and L2 again: the prefetch continues from them
    store.seen.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress("r")
    gets = [(op, keys, prefix) for op, keys, prefix in store.seen if op in ("exists", "get")]
    want = [("exists", hashes[2:], hashes[:2]), ("get", hashes[2:4], hashes[:2]), ("get", hashes[4:6], hashes[:4])]
    assert gets == (want if pass_prefix_keys else [(op, k, None) for op, k, _ in want])
    assert cache.match_prefix(key).host_hit_length + len(cache.match_prefix(key).device_indices) == 6 * PS
    cache.check_integrity()
    cache.close()


def test_a_lookup_in_batches_passes_each_batch_the_keys_before_it():
    """A lookup past 16 pages asks in batches (16, then up to 32 more); with prefix keys passed, each batch
    gets every page hash before it: the anchor's, then the batches already asked."""
    cache = make_cache(page_size=PS, device_tokens=1024, load_back_threshold=1)
    store = _PrefixKeyStore("ns", cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_stop_policy="wait_complete",
                                               hicache_storage_pass_prefix_keys=True), "test-model")
    key = RadixKey(random_tokens(40 * PS, seed=83))
    kv = compute_and_insert(cache, key, seed=84)
    cache.flush()
    hashes = list(store.blobs)
    assert len(hashes) == 40
    drop_l1_l2(cache)
    compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=0, kv=kv[:, :, : 2 * PS])
    cache.flush()
    store.seen.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress("r")
    exists = [(keys, prefix) for op, keys, prefix in store.seen if op == "exists"]
    assert exists == [(hashes[2:18], hashes[:2]), (hashes[18:40], hashes[:18])]
    assert cache.match_prefix(key).host_hit_length + len(cache.match_prefix(key).device_indices) == 40 * PS
    cache.check_integrity()
    cache.close()


def _small_l2_with_stored(key: RadixKey, stored_pages: int):
    """L1 of 8 pages and L2 of 16 (rate limit: 0.8 x 8 pages = 102 tokens); L3 holds the first
    ``stored_pages`` of ``key``, written by a larger cache sharing the store."""
    blobs: dict = {}
    writer = make_cache(page_size=PS, device_tokens=32 * PS)
    attach_fake(writer, blobs)
    compute_and_insert(writer, key, seed=43)
    writer.flush()
    writer.close()
    for stored in list(blobs)[stored_pages:]:
        del blobs[stored]
    cache = make_cache(page_size=PS, device_tokens=8 * PS)
    store = attach_fake(cache, blobs, prefetch_stop_policy="wait_complete")
    assert cache.storage.max_tokens_in_flight == int(0.8 * 8 * PS)
    return cache, store


def test_rate_limit_counts_tokens_asked_for_and_skips_only_once_full():
    """HiCache's rule: a prefetch is skipped only when the tokens asked for by prefetches not yet ended
    already reach the limit, whatever its own size; a prompt longer than the limit is still fetched."""
    long_key = RadixKey(random_tokens(12 * PS, seed=44))  # 192 tokens asked: more than the 102 limit
    cache, store = _small_l2_with_stored(long_key, stored_pages=4)
    assert cache.prefetch_from_storage("long", cache.tree.root, long_key)
    cache.storage.wait_idle()
    cache.step()  # L3 holds 4 of its 12 pages: 4 granted, but all 12 stay counted until it ends
    assert len(cache.storage.prefetches["long"].host_pages) == 4
    short_key = RadixKey(random_tokens(2 * PS, seed=45))
    assert not cache.prefetch_from_storage("short", cache.tree.root, short_key)
    assert cache.storage.stats.prefetch_rate_limited == 1
    cache.flush()
    assert cache.check_prefetch_progress("long")
    assert cache.match_prefix(long_key).host_hit_length == 4 * PS
    assert cache.prefetch_from_storage("short", cache.tree.root, short_key)  # ended: room again
    cache.flush()
    assert cache.check_prefetch_progress("short")
    cache.check_integrity()
    cache.close()
