"""Exclusive tiers with an L3: an insert is backed up to L3 per ``write_policy`` (as write-through backs it up
in inclusive tiers) through a copy the backup owns, so L2 never holds a copy of what L1 holds, and a server
sharing the L3 hits the prefix as soon as it is written, not once this one evicts it."""

import pytest
import torch

from tests.storage_util import (attach_fake, compute_and_insert, fetch_and_load, make_cache, random_tokens)
from tierkv.radix import RadixKey

PS = 16


def exclusive_cache(write_policy: str = "write_through", **storage_config):
    cache = make_cache(page_size=PS, device_tokens=1024, tier_mode="exclusive", write_policy=write_policy)
    return cache, attach_fake(cache, **storage_config)


def assert_l2_keeps_no_copy(cache) -> None:
    """No node holds both tiers, and no L2 slot is taken but by L2-only nodes."""
    nodes = list(cache.tree.nodes())
    assert not [n for n in nodes if n.device_value is not None and n.host_value is not None]
    host_only = sum(len(n) for n in nodes if n.device_value is None and n.host_value is not None)
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots - host_only
    cache.check_integrity()


def test_an_insert_is_backed_up_to_l3_and_l2_keeps_no_copy():
    # Before: exclusive tiers wrote to L3 only what L1 demoted, so this store stayed empty
    cache, store = exclusive_cache()
    key = RadixKey(random_tokens(20 * PS, seed=1))
    kv = compute_and_insert(cache, key, seed=2)
    cache.flush()
    assert len(store.blobs) == 20 and cache.storage.stats.backed_up_tokens == 20 * PS
    assert cache.stats.written_tokens == 20 * PS
    assert_l2_keeps_no_copy(cache)
    # a second server sharing the L3 hits the whole prompt, bit for bit
    other = make_cache(page_size=PS, device_tokens=1024, tier_mode="exclusive")
    attach_fake(other, blobs=store.blobs)
    started, hit_kv = fetch_and_load(other, key)
    assert started and torch.equal(hit_kv, kv)
    other.check_integrity()
    cache.close()
    other.close()


def test_a_longer_insert_copies_only_what_l3_lacks():
    cache, store = exclusive_cache()
    first = random_tokens(10 * PS, seed=3)
    compute_and_insert(cache, RadixKey(first), seed=4)
    cache.flush()
    longer = RadixKey(first + random_tokens(5 * PS, seed=5))
    m = cache.match_prefix(longer)
    cache.inc_lock_ref(m.last_device_node)
    slots = torch.cat([m.device_indices, cache.alloc_device(5 * PS)])
    cache.dec_lock_ref(m.last_device_node)
    cache.insert(longer, slots)
    cache.flush()
    # the first ten pages were neither copied to L2 nor written again
    assert cache.stats.written_tokens == 15 * PS and cache.storage.stats.backed_up_tokens == 15 * PS
    assert cache.storage.stats.backup_present_tokens == 0 and len(store.blobs) == 15
    assert_l2_keeps_no_copy(cache)
    cache.close()


def test_write_through_selective_backs_up_the_part_used_before():
    cache, store = exclusive_cache("write_through_selective")
    key = RadixKey(random_tokens(8 * PS, seed=6))
    compute_and_insert(cache, key, seed=7)
    cache.flush()
    assert not store.blobs  # used once
    longer = RadixKey(list(key.token_ids) + random_tokens(4 * PS, seed=8))
    m = cache.match_prefix(longer)
    cache.inc_lock_ref(m.last_device_node)
    slots = torch.cat([m.device_indices, cache.alloc_device(4 * PS)])
    cache.dec_lock_ref(m.last_device_node)
    cache.insert(longer, slots)
    cache.flush()
    assert len(store.blobs) == 8  # the reused part, not the new tail
    assert_l2_keeps_no_copy(cache)
    cache.close()


def test_write_back_backs_up_on_demotion_only():
    cache, store = exclusive_cache("write_back")
    key = RadixKey(random_tokens(8 * PS, seed=9))
    compute_and_insert(cache, key, seed=10)
    cache.flush()
    assert not store.blobs and cache.stats.written_tokens == 0
    cache.evict(cache.device_pool.num_slots)  # demoted to L2, then backed up from there
    cache.flush()
    assert len(store.blobs) == 8
    cache.close()


def test_a_demoted_node_already_in_l3_is_not_backed_up_again():
    cache, store = exclusive_cache()
    key = RadixKey(random_tokens(8 * PS, seed=11))
    compute_and_insert(cache, key, seed=12)
    cache.flush()
    started, calls = cache.storage.stats.backup_started, len(store.calls)
    assert cache.evict(cache.device_pool.num_slots) == 8 * PS  # demoted: copied to L2 (exclusive)
    cache.flush()
    assert cache.storage.stats.backup_started == started and len(store.calls) == calls
    assert cache.match_prefix(key).host_hit_length == 8 * PS
    cache.check_integrity()
    cache.close()


def test_no_l2_room_for_the_copy_skips_the_backup_and_the_next_insert_tries_again(monkeypatch):
    cache, store = exclusive_cache()
    key = RadixKey(random_tokens(6 * PS, seed=13))
    monkeypatch.setattr(cache.eviction, "alloc_host", lambda num_tokens: None)
    compute_and_insert(cache, key, seed=14)
    cache.flush()
    assert not store.blobs and cache.stats.write_skipped_tokens == 6 * PS
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())
    monkeypatch.undo()
    m = cache.match_prefix(key)
    cache.insert(key, m.device_indices)  # the same prompt again: nothing new, but its backup is due
    cache.flush()
    assert len(store.blobs) == 6
    assert_l2_keeps_no_copy(cache)
    cache.close()


def test_a_failed_copy_frees_its_slots_and_writes_nothing(monkeypatch):
    cache, store = exclusive_cache()
    copies = cache.transfer._cpu_copies["write"]

    def fail(*args):
        raise OSError("injected copy failure")
    monkeypatch.setattr(copies, "run", fail)
    monkeypatch.setattr(copies, "run_now", fail)
    key = RadixKey(random_tokens(6 * PS, seed=15))
    compute_and_insert(cache, key, seed=16)
    cache.flush()
    assert cache.stats.failed_copies == 1 and not store.blobs
    assert_l2_keeps_no_copy(cache)
    assert all(n.lock_ref == 0 and not n.in_storage for n in cache.tree.nodes())
    cache.close()


@pytest.mark.parametrize("hang", [False, True], ids=["done", "store-stuck"])
def test_reset_with_copies_for_l3_in_flight_leaks_no_slot(hang):
    cache, store = exclusive_cache(io_wait_timeout_s=0.05)  # a stuck store: waits give up soon
    if hang:
        store.hang.clear()
    compute_and_insert(cache, RadixKey(random_tokens(6 * PS, seed=17)), seed=18)
    cache.step()
    cache.reset()
    store.hang.set()
    cache.storage.wait_idle(5.0)
    cache.step()
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
    assert cache.device_pool.num_free_slots == cache.device_pool.num_slots
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("tier_mode", ["exclusive", "inclusive"])
def test_the_cost_model_counts_a_write_unread_only_once_l1_and_l2_could_have_let_it_go(tier_mode):
    """Its read-back lag is what the faster tiers hold: L1 and L2 under exclusive tiers, L2 (which also holds
    L1's pages) under inclusive ones. Before, none: the fraction fell on a fresh cache and L3 was never read."""
    cache = make_cache(page_size=PS, device_tokens=1024, tier_mode=tier_mode)
    attach_fake(cache)
    host_pages, device_pages = cache.host_pool.num_slots // PS, cache.device_pool.num_slots // PS
    want = host_pages + device_pages if tier_mode == "exclusive" else host_pages
    assert cache.cost_model.read_back_lag_pages == want > 0
    cache.close()
