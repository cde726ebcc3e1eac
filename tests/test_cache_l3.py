"""The L3 controller: config parsing, prefetch policies, revoke/abort/rate limit, backup, TP counts."""

import time

import pytest
import torch

from tests.storage_util import (attach_fake, compute_and_insert, drop_l1_l2, fetch_and_load, load_hit,
                                make_cache, random_tokens)
from tierkv.radix import RadixKey
from tierkv.storage.config import StorageConfig

PS = 16


# ---- config -------------------------------------------------------------------------------------
def test_config_defaults_and_json():
    assert StorageConfig.from_json(None) == StorageConfig()
    cfg = StorageConfig.from_json('{"prefetch_threshold": 64, "prefetch_timeout_base": 2, '
                                  '"prefetch_stop_policy": "timeout", "hash_algorithm": "xxh3_128"}')
    assert cfg.prefetch_threshold == 64 and cfg.prefetch_timeout_base == 2
    assert cfg.prefetch_stop_policy == "timeout" and cfg.hash_algorithm == "xxh3_128"
    assert StorageConfig().prefetch_threshold == 256
    assert cfg.prefetch_timeout_s(2048) == 2 + 2 * 0.25


def test_config_backend_keys_pass_through():
    cfg = StorageConfig.from_json('{"dir": "/tmp/x", "prefetch_threshold": 32, '
                                  '"hicache_storage_pass_prefix_keys": true}', backend_keys=["dir"])
    assert dict(cfg.backend_config) == {"dir": "/tmp/x"}
    assert cfg.prefetch_threshold == 32 and cfg.hicache_storage_pass_prefix_keys


@pytest.mark.parametrize("text, message", [
    ('{"prefetch_threshold": "256"}', "prefetch_threshold"),
    ('{"prefetch_threshold": true}', "prefetch_threshold"),
    ('{"prefetch_timeout_base": -1}', "prefetch_timeout_base"),
    ('{"hicache_storage_pass_prefix_keys": 1}', "hicache_storage_pass_prefix_keys"),
    ('{"prefetch_stop_policy": "eager"}', "prefetch_stop_policy"),
    ('{"hash_algorithm": "md5"}', "hash_algorithm"),
    ('{"no_such_key": 1}', "no_such_key"),
    ('{"prefetch_threshold": 1,}', "not valid JSON"),
    ('[1, 2]', "JSON object"),
])
def test_config_errors_name_the_key(text, message):
    with pytest.raises(ValueError, match=message):
        StorageConfig.from_json(text)


def test_config_is_frozen_and_picklable():
    import pickle
    with pytest.raises(AttributeError):
        StorageConfig().prefetch_threshold = 1  # type: ignore[misc]
    cfg = StorageConfig(backend_config={"dir": "/x"})
    assert pickle.loads(pickle.dumps(cfg)) == cfg


@pytest.mark.parametrize("backup_batch_pages, set_calls", [(None, 1), (8, 3)], ids=["default-128", "8"])
def test_a_backup_carries_backup_batch_pages_a_store_call_hicaches_128_by_default(backup_batch_pages, set_calls):
    # Backups took prefetch_batch_pages (16) a call: the file store wrote a pack file per 16 pages.
    # Unset (None), the store chooses: HiCache's 128 for all but the file store (see the file test below).
    assert StorageConfig().backup_batch_pages is None and StorageConfig().prefetch_batch_pages is None
    cache = make_cache(page_size=PS, device_tokens=1024)
    store = attach_fake(cache, **({} if backup_batch_pages is None else {"backup_batch_pages": backup_batch_pages}))
    assert cache.storage.backup_batch_pages == (128 if backup_batch_pages is None else backup_batch_pages)
    assert cache.storage.prefetch_batch_pages == cache.cost_model.batch_pages == 16
    key = RadixKey(random_tokens(20 * PS, seed=5))
    compute_and_insert(cache, key, seed=6)
    cache.flush()
    assert store.calls.count("set") == set_calls
    assert cache.storage.stats.backed_up_tokens == len(key) and len(store.blobs) == 20
    cache.close()


@pytest.mark.parametrize("backup_batch_pages, num_packs", [(None, 1), (64, 4)], ids=["store's-choice", "64"])
def test_the_file_store_takes_small_pages_in_one_pack_a_backup_and_large_reads_unless_told_otherwise(
        tmp_path, backup_batch_pages, num_packs):
    # At 128 pages a call a replay with 256-byte pages wrote 10,566 packs of 38 KiB for 2,000 requests,
    # most of its system time in creating files: the file store now asks for 4 MiB a pack.
    from tierkv.storage.file import GROUP_NBYTES, MIN_BACKUP_PACK_NBYTES, FileStore

    cache = make_cache(page_size=PS, device_tokens=4096)
    store = FileStore("test-ns", cache.host_pool.page_nbytes, str(tmp_path))
    overrides = {} if backup_batch_pages is None else {"backup_batch_pages": backup_batch_pages,
                                                      "prefetch_batch_pages": 16}
    cache.attach_storage(store, StorageConfig(prefetch_threshold=0, **overrides), "test-model")
    assert store.backup_batch_pages() == max(128, MIN_BACKUP_PACK_NBYTES // store.format.blob_nbytes) > 200
    # reads likewise: a call opens the directory, the counter and a pack, and 16 small pages are ~1 us of copying
    if backup_batch_pages is None:
        assert cache.storage.prefetch_batch_pages == max(16, GROUP_NBYTES // store.page_nbytes) > 16
    else:  # set: kept as set
        assert cache.storage.prefetch_batch_pages == 16 and cache.storage.backup_batch_pages == backup_batch_pages
    assert cache.cost_model.batch_pages == cache.storage.prefetch_batch_pages
    key = RadixKey(random_tokens(200 * PS, seed=5))
    compute_and_insert(cache, key, seed=6)
    cache.flush()
    assert cache.storage.stats.backed_up_tokens == len(key)
    assert len(list((tmp_path / store.namespace_tag).glob("*.pack"))) == num_packs
    cache.close()


# ---- prefetch -----------------------------------------------------------------------------------
def _stored_cache(num_pages: int = 8, **overrides):
    """A cache whose store holds ``num_pages`` pages of a key, with L1 and L2 emptied."""
    cache = make_cache(page_size=PS)
    store = attach_fake(cache, **overrides)
    key = RadixKey(random_tokens(num_pages * PS, seed=1))
    kv = compute_and_insert(cache, key, seed=2)
    cache.flush()
    assert cache.storage.stats.backed_up_tokens == len(key)
    drop_l1_l2(cache)
    return cache, store, key, kv


def test_an_l3_hit_counts_once_as_a_storage_hit_not_also_as_a_host_hit():
    """The match after a prefetch finds the fetched tokens in L2: they were an L3 hit (992 + 992 before)."""
    cache, _store, key, _kv = _stored_cache()
    fetch_and_load(cache, key)
    assert cache.stats.storage_hit_tokens == len(key)
    assert cache.stats.host_hit_tokens == 0 and cache.stats.device_hit_tokens == 0
    load_hit(cache, key)  # a later request: now an L1 hit, and nothing is claimed twice
    assert cache.stats.device_hit_tokens == len(key) and cache.stats.host_hit_tokens == 0
    assert not cache.storage.fetched_unmatched
    cache.close()


def test_prefetch_round_trip_inserts_host_only_nodes():
    cache, store, key, kv = _stored_cache()
    started, got = fetch_and_load(cache, key)
    assert started
    assert torch.equal(got, kv)
    assert cache.stats.storage_hit_tokens == len(key)
    for node in cache.tree.nodes():  # loaded into L1 (exclusive tiers: L2 freed its copy)
        assert node.hash_values is not None and node.in_storage and node.device_value is not None
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("num_stored, exists_sizes, num_hashed", [(60, [16, 32, 64], 112), (0, [16], 16),
                                                                  (300, [16, 32, 64, 128, 60], 300)])
def test_a_lookup_hashes_and_asks_in_growing_batches_up_to_the_first_miss(num_stored, exists_sizes, num_hashed):
    """The prefetch worker hashes the pages past the anchor batch by batch (16, 32, 64, ... pages) just before
    it asks the store for them, as HiCache's prefetch thread does, and stops at the first batch not wholly
    present: a lookup that misses early hashes no more of the prompt (the scheduler thread hashed all of
    it before). The chain is the one made by hashing the whole tail at once, and the pages found are those
    fetched and inserted, with those hashes."""
    from tierkv.hashing import page_hashes

    cache = make_cache(page_size=PS, device_tokens=512, hicache_ratio=10.0)  # L2 holds all 300 pages
    store = attach_fake(cache)
    key = RadixKey(random_tokens(300 * PS, seed=11))
    expected = page_hashes(key.token_ids, PS, cache.storage._seed(None), cache.storage.namespace)
    for page_hash in expected[:num_stored]:
        store.blobs[page_hash] = torch.zeros(store.page_nbytes, dtype=torch.uint8)
    asked = []
    real_exists = store.batch_exists
    store.batch_exists = lambda keys: asked.append(len(keys)) or real_exists(keys)
    match = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", match.last_host_node, key)
    prefetch = cache.storage.prefetches["r"]
    assert prefetch.exists_done.wait(10) and prefetch.num_pages == 300
    assert asked == exists_sizes and prefetch.found_pages == num_stored
    assert prefetch.hashes == expected[:num_hashed]
    cache.flush()
    assert cache.check_prefetch_progress("r")
    fetched = [n for n in cache.tree.nodes() if n.host_value is not None]
    assert sum(len(n) for n in fetched) == num_stored * PS
    assert all(n.hash_values == expected[:len(n) // PS] for n in fetched)
    cache.check_integrity()
    cache.close()


def test_prefetch_threshold():
    cache, store, key, kv = _stored_cache(num_pages=4, prefetch_threshold=4 * PS + 1)
    m = cache.match_prefix(key)
    assert not cache.prefetch_from_storage("r", m.last_host_node, key)
    assert cache.check_prefetch_progress("r")
    assert "get" not in store.calls
    cache.check_integrity()
    cache.close()


def test_prefetch_continues_from_host_hit():
    """Half the key stays in L2; only the other half comes from L3, hashed on from the L2 node."""
    cache, store, key, kv = _stored_cache(num_pages=8)
    half = RadixKey(key.token_ids[: 4 * PS])
    _, got = fetch_and_load(cache, half, "first")
    assert torch.equal(got, kv[:, :, : 4 * PS])
    cache.evict(cache.device_pool.num_slots)  # the half is now host-only
    m = cache.match_prefix(key)
    assert m.host_hit_length == 4 * PS
    assert cache.prefetch_from_storage("second", m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress("second")
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def test_prefetch_frees_pages_the_tree_got_meanwhile():
    cache, store, key, kv = _stored_cache(num_pages=8)
    store.hang.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    # another request computes the first half while the prefetch runs
    compute_and_insert(cache, RadixKey(key.token_ids[: 3 * PS]), seed=0, kv=kv[:, :, : 3 * PS])
    store.hang.set()
    cache.flush()
    assert cache.check_prefetch_progress("r")
    cache.check_integrity()
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def test_best_effort_takes_what_is_done():
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_stop_policy="best_effort")
    store.hang.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.step()
    assert cache.check_prefetch_progress("r")  # goes at once, with nothing fetched yet
    assert cache.match_prefix(key).host_hit_length == 0
    assert not cache.storage.draining and cache.storage.owned_host_slots() == []  # a lookup owns no slot
    cache.check_integrity()
    store.hang.set()
    cache.flush()
    assert not cache.storage.draining
    cache.check_integrity()
    cache.close()


def _held_prefetch_waits_then_gets_every_page(cache, store, key, kv, steps: int = 1, pause_s: float = 0.0):
    """Hold the store, start a prefetch: after ``pause_s`` and ``steps`` steps it is still waiting; released,
    it ends with every page in L2, bit-exact."""
    store.hang.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    time.sleep(pause_s)
    for _ in range(steps):
        cache.step()
        assert not cache.check_prefetch_progress("r")
    store.hang.set()
    cache.flush()
    assert cache.check_prefetch_progress("r")
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def test_wait_complete_waits_for_all_pages():
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_stop_policy="wait_complete",
                                          prefetch_batch_pages=2)
    _held_prefetch_waits_then_gets_every_page(cache, store, key, kv, steps=3)


def test_wait_complete_has_no_time_budget_as_hicache():
    """A slow store (here: held past a zero budget) still gives every page: the timeout policy's budget
    is not wait_complete's (before the fix a run slower than 1 s + 0.25 s/Ki tokens got no L3 hit)."""
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_stop_policy="wait_complete",
                                          prefetch_timeout_base=0.0, prefetch_timeout_per_ki_token=0.0)
    _held_prefetch_waits_then_gets_every_page(cache, store, key, kv, pause_s=0.05)


def test_wait_complete_gives_up_on_a_store_that_makes_no_progress_for_io_wait_timeout_s():
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_stop_policy="wait_complete",
                                          io_wait_timeout_s=0.2)
    store.hang.clear()
    try:
        m = cache.match_prefix(key)
        calls = len(store.calls)
        assert cache.prefetch_from_storage("r", m.last_host_node, key)
        store.wait_for_calls(calls + 1)  # the lookup is stuck inside the store
        time.sleep(0.25)
        cache.step()
        assert cache.check_prefetch_progress("r")  # no progress for io_wait_timeout_s: goes without L3
        assert cache.match_prefix(key).host_hit_length == 0
        assert cache.storage.owned_host_slots() == []
    finally:
        store.hang.set()
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_timeout_policy_gives_up():
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_stop_policy="timeout",
                                          prefetch_timeout_base=0.0, prefetch_timeout_per_ki_token=0.0)
    store.hang.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.step()
    assert cache.check_prefetch_progress("r")
    assert cache.match_prefix(key).host_hit_length == 0
    store.hang.set()
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_timeout_policy_waits_within_budget():
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_stop_policy="timeout",
                                          prefetch_timeout_base=3600.0)
    _held_prefetch_waits_then_gets_every_page(cache, store, key, kv)


def test_revoke_when_nothing_is_stored():
    cache = make_cache(page_size=PS)
    attach_fake(cache)
    key = RadixKey(random_tokens(6 * PS, seed=5))
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    assert cache.storage.owned_host_slots()[0].numel() == 0  # no slot before L3 says what it holds
    cache.flush()
    assert cache.storage.stats.prefetch_revoked == 1
    assert cache.storage.owned_host_slots() == []
    cache.check_integrity()
    assert cache.check_prefetch_progress("r")
    assert not cache.storage.prefetches
    cache.close()


def test_abort_releases_everything():
    cache, store, key, kv = _stored_cache(num_pages=8)
    store.hang.clear()
    m = cache.match_prefix(key)
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.release_prefetch("r")
    cache.check_integrity()
    store.hang.set()
    cache.flush()
    assert cache.storage.owned_host_slots() == []
    assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
    assert cache.storage.stats.prefetch_aborted == 1
    assert cache.check_prefetch_progress("r")
    cache.check_integrity()
    cache.close()


def test_rate_limit_by_tokens_in_flight():
    cache, store, key, kv = _stored_cache(num_pages=8, prefetch_max_tokens_in_flight=8 * PS)
    other = RadixKey(random_tokens(2 * PS, seed=9))
    store.hang.clear()
    assert cache.prefetch_from_storage("a", cache.tree.root, key)
    assert not cache.prefetch_from_storage("b", cache.tree.root, other)
    assert cache.storage.stats.prefetch_rate_limited == 1
    store.hang.set()
    cache.flush()
    assert cache.check_prefetch_progress("a")
    assert cache.prefetch_from_storage("b", cache.tree.root, other)
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_duplicate_request_id_is_an_error():
    cache, store, key, kv = _stored_cache(num_pages=2)
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    with pytest.raises(ValueError, match="already has a prefetch"):
        cache.prefetch_from_storage("r", cache.tree.root, key)
    cache.flush()
    assert cache.check_prefetch_progress("r")
    other = RadixKey(random_tokens(2 * PS, seed=22))
    assert cache.prefetch_from_storage("s", cache.tree.root, other)
    cache.flush()  # revoked: nothing stored under it
    assert cache.prefetch_from_storage("s", cache.tree.root, other)  # the id is free again
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_extra_keys_never_share_pages():
    cache = make_cache(page_size=PS)
    attach_fake(cache)
    tokens = random_tokens(4 * PS, seed=3)
    compute_and_insert(cache, RadixKey(tokens, "tenant-a"), seed=4)
    drop_l1_l2(cache)
    started, got = fetch_and_load(cache, RadixKey(tokens, "tenant-b"))
    assert started and got.shape[2] == 0
    assert cache.storage.stats.prefetch_revoked == 1
    started, got = fetch_and_load(cache, RadixKey(tokens, "tenant-a"), "r2")
    assert got.shape[2] == 4 * PS
    cache.close()


# ---- backup -------------------------------------------------------------------------------------
def test_backup_skips_pages_already_stored():
    first = make_cache(page_size=PS)
    blobs: dict = {}
    attach_fake(first, blobs)
    key = RadixKey(random_tokens(4 * PS, seed=6))
    compute_and_insert(first, key, seed=7)
    first.flush()
    second = make_cache(page_size=PS)
    store = attach_fake(second, blobs)
    compute_and_insert(second, key, seed=7)
    second.flush()
    assert "set" not in store.calls
    assert second.storage.stats.backup_present_tokens == 4 * PS
    assert second.storage.stats.backed_up_tokens == 0
    first.close()
    second.close()


def test_backup_protects_host_pages_until_acknowledged():
    cache = make_cache(page_size=PS, tier_mode="inclusive")
    store = attach_fake(cache)
    store.hang.clear()
    key = RadixKey(random_tokens(4 * PS, seed=8))
    compute_and_insert(cache, key, seed=8)
    cache.transfer.synchronize()
    cache.step()  # the L2 write retires, the L3 backup starts and hangs
    assert len(cache.storage.backups) == 1
    cache.evict(cache.device_pool.num_slots)
    assert cache.evict_host(cache.host_pool.num_slots) == 0  # host_ref keeps the pages
    store.hang.set()
    cache.flush()
    assert cache.evict_host(cache.host_pool.num_slots) == 4 * PS
    cache.check_integrity()
    cache.close()


def test_write_back_eviction_backs_up():
    cache = make_cache(page_size=PS, write_policy="write_back")
    attach_fake(cache)
    key = RadixKey(random_tokens(4 * PS, seed=10))
    kv = compute_and_insert(cache, key, seed=11)
    cache.flush()
    assert cache.storage.stats.backed_up_tokens == 0
    cache.evict(cache.device_pool.num_slots)
    cache.flush()
    assert cache.storage.stats.backed_up_tokens == 4 * PS
    cache.evict_host(cache.host_pool.num_slots)
    _, got = fetch_and_load(cache, key)
    assert torch.equal(got, kv)
    cache.close()


def test_backup_queue_cap_drops_backups():
    cache = make_cache(page_size=PS, tier_mode="inclusive")
    store = attach_fake(cache, backup_max_pending_tokens=4 * PS)
    store.hang.clear()
    compute_and_insert(cache, RadixKey(random_tokens(4 * PS, seed=12)), seed=1)
    compute_and_insert(cache, RadixKey(random_tokens(4 * PS, seed=13)), seed=1)
    cache.transfer.synchronize()
    cache.step()
    assert len(cache.storage.backups) == 1
    assert cache.storage.stats.backup_dropped_tokens == 4 * PS
    store.hang.set()
    cache.flush()
    cache.close()


# ---- TP agreement -------------------------------------------------------------------------------
def test_progress_counts_layout_and_zero_is_no_news():
    cache, store, key, kv = _stored_cache(num_pages=4, prefetch_stop_policy="wait_complete")
    other = RadixKey(random_tokens(2 * PS, seed=14))
    assert cache.prefetch_from_storage("a", cache.tree.root, key)
    assert cache.prefetch_from_storage("b", cache.tree.root, other)
    cache.storage.wait_idle()
    counts, flags = cache.local_progress()
    # backups done; then per prefetch: pages, finished, 1 + found, timed out. "a" waits for its slots;
    # "b" found nothing and is done without any
    assert counts[2:] == [0, 0, 0, 5, 0, 0, 1, 1, 0]
    assert flags == [0, 0]  # per prefetch: terminated (failed short)
    # a step that agrees on nothing (another rank is behind) changes nothing
    cache.apply_progress([0] * len(counts), [0] * len(flags))
    assert not cache.check_prefetch_progress("a")
    assert cache.storage.stats.prefetch_revoked == 0 and cache.storage.owned_host_slots()[0].numel() == 0
    # the pages found agreed: "a" gets slots for its 4 and reads them; "b" is revoked
    cache.apply_progress(counts[:2] + [0, 0, 0, 5, 0, 0, 1, 1, 0], [0, 0])
    assert cache.storage.stats.prefetch_revoked == 1
    assert [len(s) for s in cache.storage.owned_host_slots()] == [4 * PS]
    cache.storage.wait_idle()
    counts, flags = cache.local_progress()
    assert counts[2:] == [0, 4, 1, 5, 0]
    # the slowest rank got 2 pages of "a": every rank inserts exactly 2
    cache.apply_progress(counts[:3] + [2, 1, 5, 0], [0])
    assert cache.check_prefetch_progress("a") and cache.check_prefetch_progress("b")
    assert cache.match_prefix(key).host_hit_length == 2 * PS
    cache.check_integrity()
    cache.close()


def test_prefetch_under_a_device_only_prefix():
    """write_back keeps a recomputed prefix L1-only: the prefetch reads past it; that node keeps no L2
    copy, the rest is host-only below it."""
    cache = make_cache(page_size=PS, write_policy="write_back")
    attach_fake(cache)
    key = RadixKey(random_tokens(6 * PS, seed=15))
    kv = compute_and_insert(cache, key, seed=16)
    cache.evict(cache.device_pool.num_slots)
    cache.flush()
    cache.evict_host(cache.host_pool.num_slots)
    compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=0, kv=kv[:, :, : 2 * PS])
    m = cache.match_prefix(key)
    assert m.last_host_node.host_value is None and len(m.device_indices) == 2 * PS
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress("r")
    assert [n.host_value is not None for n in cache.tree.match(key, touch=False).nodes] == [False, True]
    cache.check_integrity()
    assert torch.equal(load_hit(cache, key), kv)
    cache.close()


def test_write_back_prefetch_reads_past_an_l1_only_prefix():
    """write_back: prefix A stays in L1 only, so neither L2 nor L3 ever gets its pages; its child B was
    written back and backed up. The prefetch must look L3 up past the match (A), not from the deepest
    L2 node (the root), whose first page L3 never held (0 % L3 hits under write_back)."""
    cache = make_cache(page_size=PS, write_policy="write_back")
    store = attach_fake(cache)
    key = RadixKey(random_tokens(6 * PS, seed=19))
    kv = compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=0)
    kv = torch.cat([kv, compute_and_insert(cache, key, seed=20)[:, :, 2 * PS:]], dim=2)
    cache.match_prefix(RadixKey(key.token_ids[: 2 * PS]))  # A used last: B is L1's victim
    assert cache.evict(4 * PS) == 4 * PS
    cache.flush()
    cache.evict_host(cache.host_pool.num_slots)
    assert len(store.blobs) == 4  # B's pages, named by the whole prefix
    m = cache.match_prefix(key)
    assert len(m.device_indices) == 2 * PS and m.last_host_node.host_value is None
    assert cache.prefetch_from_storage("r", m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress("r")
    assert cache.storage.stats.prefetched_tokens == 4 * PS
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def test_bigram_keys_round_trip():
    cache = make_cache(page_size=PS, bigram=True)
    attach_fake(cache)
    key = RadixKey(random_tokens(4 * PS + 1, seed=17))  # 4 pages of token pairs
    kv = compute_and_insert(cache, key, seed=18)
    drop_l1_l2(cache)
    started, got = fetch_and_load(cache, key)
    assert started and torch.equal(got, kv)
    cache.close()


def test_two_ranks_agree_on_the_slowest():
    """Two caches stand for two TP ranks; rank 1's store lost pages 3+. With counts agreed by MIN both
    insert the same 3 pages and end with identical trees."""
    ranks, stores = [], []
    key = RadixKey(random_tokens(8 * PS, seed=19))
    for rank in range(2):
        cache = make_cache(page_size=PS)
        stores.append(attach_fake(cache, prefetch_stop_policy="wait_complete"))
        compute_and_insert(cache, key, seed=20 + rank)
        drop_l1_l2(cache)
        ranks.append(cache)
    for k in list(stores[1].blobs)[3:]:
        del stores[1].blobs[k]
    for cache in ranks:
        assert cache.prefetch_from_storage("r", cache.tree.root, key)
    for _ in range(2):  # agree the pages found (each rank then takes slots for 3), then the pages read
        for cache in ranks:
            cache.storage.wait_idle()
        progress = [c.local_progress() for c in ranks]
        agreed_min = [min(a, b) for a, b in zip(*(p[0] for p in progress))]
        agreed_max = [max(a, b) for a, b in zip(*(p[1] for p in progress))]
        for cache in ranks:
            cache.apply_progress(agreed_min, agreed_max)
    for cache in ranks:
        assert cache.check_prefetch_progress("r")
        cache.check_integrity()
    shapes = [[(len(n), n.hash_values) for n in c.tree.nodes()] for c in ranks]
    assert shapes[0] == shapes[1] and sum(s[0] for s in shapes[0]) == 3 * PS
    for cache in ranks:
        cache.close()


def test_reset_keeps_a_shared_store_unless_asked():
    cache, store, key, kv = _stored_cache(num_pages=4)
    cache.reset()
    assert store.blobs
    cache.check_integrity()
    cache.close()


def test_reset_drops_everything_in_all_tiers():
    cache, store, key, kv = _stored_cache(num_pages=4)
    store.hang.clear()
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    store.hang.set()
    cache.reset(clear_storage=True)
    assert not store.blobs and not cache.storage.prefetches and cache.storage.owned_host_slots() == []
    cache.check_integrity()
    started, got = fetch_and_load(cache, key)
    assert got.shape[2] == 0
    cache.close()


def test_open_storage_from_spec_and_json(tmp_path):
    from tierkv.cache.l3.controller import open_storage
    cache = make_cache(page_size=PS)
    controller = open_storage(cache, f"file://{tmp_path}", '{"prefetch_threshold": 32, "fsync": true}',
                              "spec-model")
    assert controller is cache.storage and controller.config.prefetch_threshold == 32
    assert controller.store.fsync
    with pytest.raises(ValueError, match="redis_only"):
        open_storage(make_cache(page_size=PS), "memory", '{"redis_only": 1}', "m")
    cache.close()


def test_match_walks_the_whole_path():
    """Regression: RadixTree.match stopped after the first level of the tree."""
    cache = make_cache(page_size=PS)
    key = RadixKey(random_tokens(4 * PS, seed=21))
    compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=1)
    slots = cache.alloc_device(2 * PS)
    cache.insert(key, torch.cat([cache.match_prefix(key).device_indices, slots]))
    assert len(cache.tree.root.children) == 1
    assert len(cache.match_prefix(key).device_indices) == 4 * PS
    cache.close()


# ---- stateful: random traffic with faults keeps KV exact and slots balanced ------------------------
from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402


def _kv_of(spec, tokens: list[int]) -> torch.Tensor:
    """KV as a function of the token id alone (ids are unique per prefix position in this machine)."""
    values = torch.tensor(tokens, dtype=torch.float32).remainder(1000)
    kv = values.view(1, 1, -1, 1, 1).expand(spec.num_kv, spec.num_layers, -1, spec.heads, spec.dim)
    return kv.to(spec.dtype).contiguous()


class StorageTraffic(RuleBasedStateMachine):
    """Requests with prefetch/abort, evictions in both tiers, an L3 that fails or corrupts pages, and
    resets while L3 calls are stuck (backups of sibling prompts in flight share their prefix's slots)."""

    @initialize(policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
                write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                tier_mode=st.sampled_from(["inclusive", "exclusive"]))
    def start(self, policy, write_policy, tier_mode):
        self.cache = make_cache(page_size=4, device_tokens=96, write_policy=write_policy, tier_mode=tier_mode)
        # waits for stuck I/O (flush, reset) give up soon; every loop below retries them
        self.store = attach_fake(self.cache, prefetch_batch_pages=2, backup_batch_pages=2,
                                 io_wait_timeout_s=0.05, prefetch_stop_policy=policy, prefetch_threshold=4)
        self.stalled = False
        self.bases = [list(range(1000 * b + 1, 1000 * b + 41)) for b in range(3)]
        self.next_token = 10_000

    @rule(base=st.integers(0, 2), pages=st.integers(1, 10), tail_pages=st.integers(0, 2), abort=st.booleans(),
          settle=st.booleans())
    def request(self, base, pages, tail_pages, abort, settle):
        tail = list(range(self.next_token, self.next_token + 4 * tail_pages))
        self.next_token += 4 * tail_pages
        key = RadixKey(self.bases[base][: 4 * pages] + tail)
        rid = f"r{self.next_token}-{base}-{pages}"
        m = self.cache.match_prefix(key)
        # while L3 is stuck a prefetch could never finish: the request runs without one
        started = not self.stalled and self.cache.prefetch_from_storage(rid, m.last_host_node, key)
        if settle:  # the scheduler ran other work meanwhile: the prefetch's worker is done
            self.cache.storage.wait_idle()
        self.cache.step()
        if started and abort:
            self.cache.release_prefetch(rid)
        while not self.cache.check_prefetch_progress(rid):
            self.cache.flush()
        self.cache.check_integrity()
        m = self.cache.match_prefix(key)
        load = self.cache.init_load_back(m.last_host_node)
        if load.pending is not None:
            assert load.pending.wait()
        hit = load.device_indices
        spec = self.cache.device_pool.spec
        if len(hit):
            assert torch.equal(self.cache.device_pool.read_tokens(hit), _kv_of(spec, key.token_ids[: len(hit)]))
        self.cache.inc_lock_ref(load.last_node)
        fresh = self.cache.alloc_device(len(key) - len(hit))
        self.cache.dec_lock_ref(load.last_node)
        if fresh is None:
            return
        self.cache.device_pool.write_tokens(fresh, _kv_of(spec, key.token_ids[len(hit):]))
        self.cache.insert(key, torch.cat([hit, fresh]))

    @rule(num_tokens=st.integers(4, 96))
    def evict_device(self, num_tokens):
        self.cache.evict(num_tokens)

    @rule(num_tokens=st.integers(4, 192))
    def evict_host(self, num_tokens):
        self.cache.evict_host(num_tokens)

    @rule()
    def flush(self):
        self.cache.flush()

    @rule()
    def drop_l1_and_l2(self):
        self.cache.flush()
        self.cache.evict(self.cache.device_pool.num_slots)
        self.cache.flush()  # write_back eviction just started backups that protect their L2 pages
        self.cache.evict_host(self.cache.host_pool.num_slots)

    @precondition(lambda self: not self.stalled)
    @rule()
    def stall_l3(self):
        self.store.hang.clear()  # every L3 call now blocks inside the store until resume_l3
        self.stalled = True

    @precondition(lambda self: self.stalled)
    @rule()
    def resume_l3(self):
        self.store.hang.set()
        self.stalled = False

    @rule(clear_storage=st.booleans())
    def reset(self, clear_storage):
        self.cache.reset(clear_storage=clear_storage)

    @rule(fail=st.booleans())
    def toggle_failures(self, fail):
        self.store.fail = fail

    @rule(index=st.integers(0, 1000))
    def corrupt_a_page(self, index):
        keys = sorted(self.store.blobs)
        if keys:
            self.store.corrupt.add(keys[index % len(keys)])

    @invariant()
    def slots_balance(self):
        self.cache.check_integrity()

    def teardown(self):
        if hasattr(self, "cache"):
            self.store.hang.set()
            self.cache.close()


StorageTraffic.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_storage_traffic = StorageTraffic.TestCase


# ---- write-back under an L1-only parent (L2 need not be a rooted subtree) -----------------------------
def _leaf_in_l2_under_l1_parent(store_hangs: bool):
    """write_back cache: a 2-page parent in L1 only and a 2-page leaf written back to L2 under it, its
    L3 backup hanging (protected) when ``store_hangs``."""
    # whole-node eviction (HiCache's): evict(1) takes the whole leaf
    cache = make_cache(page_size=PS, write_policy="write_back", split_victims=False)
    store = attach_fake(cache)
    key = RadixKey(random_tokens(4 * PS, seed=20))
    kv = compute_and_insert(cache, RadixKey(key.token_ids[: 2 * PS]), seed=21)
    kv = torch.cat([kv, compute_and_insert(cache, key, seed=22)[:, :, 2 * PS:]], dim=2)
    if store_hangs:
        store.hang.clear()
    assert cache.evict(1) == 2 * PS
    leaf = cache.tree.match(key, touch=False).last_node
    assert leaf.host_value is not None and leaf.parent.host_value is None and leaf.parent.device_value is not None
    return cache, store, key, kv, leaf


def test_backup_under_an_l1_parent_writes_the_leaf_pages_named_by_the_whole_prefix():
    cache, store, key, kv, leaf = _leaf_in_l2_under_l1_parent(store_hangs=False)
    cache.flush()
    hashes = cache.storage.path_hashes(leaf)
    assert sorted(store.blobs) == sorted(hashes[2:])  # the parent's pages wait for its own write-back
    assert cache.storage.stats.backed_up_tokens == 2 * PS
    cache.evict(cache.device_pool.num_slots)  # now the parent: written back, then backed up in turn
    cache.flush()
    assert sorted(store.blobs) == sorted(hashes)
    drop_l1_l2(cache)
    _, got = fetch_and_load(cache, key)
    assert torch.equal(got, kv)
    cache.close()


def test_l1_keeps_a_parent_whose_l2_only_child_is_being_backed_up_when_l2_has_no_room():
    cache, store, key, kv, leaf = _leaf_in_l2_under_l1_parent(store_hangs=True)
    cache.step()  # the L3 backup of the leaf is running: its pages are protected
    assert leaf.host_ref > 0
    held = cache.host_pool.alloc(cache.host_pool.num_free_slots)  # L2 has no room for the parent
    assert cache.evict(cache.device_pool.num_slots) == 0  # deleting it would delete pages in use
    assert leaf.parent.device_value is not None
    cache.check_integrity(caller_host_slots=held)
    cache.host_pool.free(held)
    store.hang.set()
    cache.flush()
    assert cache.evict(cache.device_pool.num_slots) == 2 * PS  # room again: written back
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def test_failed_write_back_puts_back_a_parent_whose_l2_only_child_is_being_backed_up():
    cache, store, key, kv, leaf = _leaf_in_l2_under_l1_parent(store_hangs=True)
    cache.step()
    write_now = cache.transfer.write_now
    cache.transfer.write_now = lambda device_slots, host_slots: OSError("injected")
    free_before = cache.device_pool.num_free_slots
    assert cache.evict(cache.device_pool.num_slots) == 0  # the copy failed: the parent is put back
    assert cache.device_pool.num_free_slots == free_before and cache.stats.failed_copies == 1
    assert leaf.parent.device_value is not None and leaf.parent.host_value is None
    cache.check_integrity()
    cache.transfer.write_now = write_now
    store.hang.set()
    cache.flush()
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()
