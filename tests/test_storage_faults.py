"""Faults in L3 degrade to recompute: never wrong KV, never a crash, never a leaked slot, no stuck thread."""

import os
import time
import uuid

import pytest
import torch

from tests.storage_util import (FakeStore, attach_fake, compute_and_insert, drop_l1_l2, fetch_and_load,
                                load_hit, make_cache, random_tokens, storage_config)
from tierkv.hashing import HashNamespace
from tierkv.radix import RadixKey
from tierkv.storage.factory import open_store

PS = 16


def _finish_request(cache, key, kv):
    """The request recomputes what the cache did not give it and inserts the whole prompt."""
    m = cache.match_prefix(key)
    load = cache.init_load_back(m.last_host_node)
    if load.pending is not None:
        assert load.pending.wait()
    hit = load.device_indices
    fresh = cache.alloc_device(len(key) - len(hit))
    cache.device_pool.write_tokens(fresh, kv[:, :, len(hit):])
    assert cache.insert(key, torch.cat([hit, fresh])) == len(key)
    cache.flush()
    assert torch.equal(load_hit(cache, key), kv)  # L1/L2 serve the whole prompt, bit-exact
    cache.check_integrity()
    return len(hit)


def test_backend_that_raises_everywhere():
    cache = make_cache(page_size=PS)
    store = attach_fake(cache)
    store.fail = True
    key = RadixKey(random_tokens(6 * PS, seed=1))
    kv = compute_and_insert(cache, key, seed=2)
    cache.flush()
    assert cache.storage.stats.backup_failed_pages == 6
    assert torch.equal(load_hit(cache, key), kv)  # L1 keeps serving
    drop_l1_l2(cache)
    started, got = fetch_and_load(cache, key)
    assert started and got.shape[2] == 0
    assert cache.storage.stats.prefetch_revoked == 1
    assert _finish_request(cache, key, kv) == 0
    cache.close()


class _FailsAfterFirstGet(FakeStore):
    def batch_get(self, keys, targets):
        if "get" in self.calls:
            raise ConnectionError("connection reset")
        return super().batch_get(keys, targets)


def test_backend_that_fails_mid_prefetch_gives_the_pages_read_before():
    cache = make_cache(page_size=PS)
    store = _FailsAfterFirstGet("test-ns", cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(prefetch_batch_pages=2), "test-model")
    key = RadixKey(random_tokens(6 * PS, seed=3))
    kv = compute_and_insert(cache, key, seed=4)
    drop_l1_l2(cache)
    started, got = fetch_and_load(cache, key)
    assert started and torch.equal(got, kv[:, :, : 2 * PS])
    assert _finish_request(cache, key, kv) == 2 * PS
    cache.close()


def test_hanging_backend_timeout_policy_and_bounded_waits():
    cache = make_cache(page_size=PS, tier_mode="inclusive")  # exclusive: the hung backups own L2 copies
    store = attach_fake(cache, prefetch_stop_policy="timeout", prefetch_timeout_base=0.0,
                        prefetch_timeout_per_ki_token=0.0, io_wait_timeout_s=0.2)
    key = RadixKey(random_tokens(6 * PS, seed=5))
    kv = compute_and_insert(cache, key, seed=6)
    cache.flush()
    drop_l1_l2(cache)
    store.hang.clear()
    try:
        m = cache.match_prefix(key)
        calls = len(store.calls)
        assert cache.prefetch_from_storage("r", m.last_host_node, key)
        store.wait_for_calls(calls + 1)  # the worker is stuck inside the store
        cache.step()
        assert cache.check_prefetch_progress("r")  # gave up: the request goes without L3
        assert _finish_request(cache, key, kv) == 0  # backups of it now hang too; flush stays bounded
        assert cache.storage.owned_host_slots() == []  # the hung lookup was never granted a slot
        cache.check_integrity()
        started = time.monotonic()
        cache.close()
        assert time.monotonic() - started < 30  # a bound on being stuck, not a speed check
    finally:
        store.hang.set()


def test_corrupt_page_on_disk_is_a_miss(tmp_path):
    cache = make_cache(page_size=PS, host_layout="page_first")
    ns = HashNamespace.for_spec("fault-model", cache.device_pool.spec, "page_first")
    store = open_store(f"file://{tmp_path}", ns.name(), cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(), ns)
    key = RadixKey(random_tokens(6 * PS, seed=7))
    kv = compute_and_insert(cache, key, seed=8)
    cache.flush()
    hashes = cache.storage.path_hashes(cache.match_prefix(key).last_device_node)
    path, payload_at, _ = store.page_extent(hashes[3])
    with open(path, "r+b") as f:  # flip one payload byte of page 3 (its pack holds the others too)
        f.seek(payload_at + store.page_nbytes - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    drop_l1_l2(cache)
    started, got = fetch_and_load(cache, key)
    assert started and torch.equal(got, kv[:, :, : 3 * PS])
    assert store.stats.corrupt_pages == 1
    assert _finish_request(cache, key, kv) == 3 * PS
    cache.close()


def test_redis_killed_mid_run(redis_server):
    cache = make_cache(page_size=PS)
    ns = HashNamespace.for_spec("redis-fault-model", cache.device_pool.spec, cache.host_pool.layout)
    store = open_store(redis_server.url, ns.name(), cache.host_pool.page_nbytes,
                       {"key_prefix": f"fault-{uuid.uuid4().hex[:8]}:", "retry_backoff_s": 0.01,
                        "timeout_s": 2.0})
    cache.attach_storage(store, storage_config(), ns)
    first = RadixKey(random_tokens(4 * PS, seed=9))
    kv_first = compute_and_insert(cache, first, seed=10)
    cache.flush()
    assert cache.storage.stats.backed_up_tokens == 4 * PS
    try:
        redis_server.kill()
        second = RadixKey(random_tokens(4 * PS, seed=11))
        kv_second = compute_and_insert(cache, second, seed=12)
        cache.flush()
        assert cache.storage.stats.backup_failed_pages == 4
        assert torch.equal(load_hit(cache, second), kv_second)  # L1/L2 keep serving
        drop_l1_l2(cache)
        started, got = fetch_and_load(cache, first)
        assert started and got.shape[2] == 0  # L3 is gone: the request recomputes
        assert _finish_request(cache, first, kv_first) == 0
    finally:
        redis_server.restart()
    time.sleep(0.05)  # past the client's retry backoff
    third = RadixKey(random_tokens(4 * PS, seed=13))
    kv_third = compute_and_insert(cache, third, seed=14)
    cache.flush()
    drop_l1_l2(cache)
    started, got = fetch_and_load(cache, third, "again")
    assert started and torch.equal(got, kv_third)
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_integrity_through_mixed_traffic(policy):
    """Many overlapping prompts with prefetches, aborts and evictions: slots always balance."""
    cache = make_cache(page_size=PS, device_tokens=256)
    attach_fake(cache, prefetch_stop_policy=policy, prefetch_batch_pages=1, backup_batch_pages=1)
    base = random_tokens(8 * PS, seed=15)
    truth = {}
    for i in range(12):
        key = RadixKey(base[: (2 + i % 6) * PS] + random_tokens((i % 3) * PS, seed=100 + i))
        truth[tuple(key.token_ids)] = None
        m = cache.match_prefix(key)
        started = cache.prefetch_from_storage(f"r{i}", m.last_host_node, key)
        cache.step()
        if started and i % 4 == 3:
            cache.release_prefetch(f"r{i}")
        else:
            while not cache.check_prefetch_progress(f"r{i}"):
                cache.step()
        cache.check_integrity()
        m = cache.match_prefix(key)
        load = cache.init_load_back(m.last_host_node)
        if load.pending is not None:
            load.pending.wait()
        hit = load.device_indices
        fresh = cache.alloc_device(len(key) - len(hit))
        assert fresh is not None
        cache.insert(key, torch.cat([hit, fresh]))
        cache.step()
        cache.check_integrity()
        if i % 5 == 4:
            cache.evict(128)
            cache.evict_host(128)
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_close_with_two_hung_workers_waits_one_io_wait_timeout_in_all(monkeypatch):
    """README: close waits at most io_wait_timeout_s; it used to wait that long per worker (issue 11, 11)."""
    cache = make_cache(page_size=PS)
    store = attach_fake(cache, prefetch_stop_policy="timeout", prefetch_timeout_base=0.0,
                        prefetch_timeout_per_ki_token=0.0, io_wait_timeout_s=0.2)
    first, second = RadixKey(random_tokens(6 * PS, seed=11)), RadixKey(random_tokens(6 * PS, seed=12))
    compute_and_insert(cache, first, seed=13)
    cache.flush()
    drop_l1_l2(cache)
    store.hang.clear()
    try:
        calls = len(store.calls)
        assert cache.prefetch_from_storage("r", cache.match_prefix(first).last_host_node, first)
        compute_and_insert(cache, second, seed=14)
        cache.flush()  # retires its L2 write, which starts its backup: that one hangs in the other worker
        store.wait_for_calls(calls + 2)
        storage = cache.storage
        waits = _fake_clock_joins(monkeypatch, storage)
        storage.close()
        assert len(waits) == 2 and sum(waits) <= storage.config.io_wait_timeout_s
    finally:
        store.hang.set()
        monkeypatch.undo()
    cache.close()  # stops the copy threads too: no thread outlives the test


def test_cache_close_waits_one_io_wait_timeout_for_l3_in_all(monkeypatch):
    """The cache's own close used to flush (one bounded wait on L3) and then stop the workers (a second)."""
    cache = make_cache(page_size=PS)
    store = attach_fake(cache, io_wait_timeout_s=0.2)
    key = RadixKey(random_tokens(6 * PS, seed=15))
    store.hang.clear()
    try:
        calls = len(store.calls)
        compute_and_insert(cache, key, seed=16)
        cache.flush()  # retires the L2 write, which starts its backup: it hangs in the store
        store.wait_for_calls(calls + 1)
        idle_waits: list[float | None] = []
        monkeypatch.setattr(cache.storage, "wait_idle", lambda timeout_s=None: idle_waits.append(timeout_s))
        joins = _fake_clock_joins(monkeypatch, cache.storage)
        cache.close()
        assert idle_waits == [], "close must not wait for L3 before stopping its workers"
        assert sum(joins) <= cache.storage.config.io_wait_timeout_s
    finally:
        store.hang.set()


def _fake_clock_joins(monkeypatch, storage) -> list[float]:
    """A fake clock for the storage workers' stop that moves only by what each join may wait (no real
    waiting, no timing); returns the list each join's timeout is appended to."""
    import tierkv.storage.worker as worker_module
    now, joins = [0.0], []
    monkeypatch.setattr(worker_module, "monotonic", lambda: now[0], raising=False)
    for worker in (storage._prefetch_worker, storage._backup_worker):
        real_join = worker._thread.join

        def join(timeout=None, real_join=real_join):
            joins.append(timeout)
            now[0] += timeout
            real_join(0)
        monkeypatch.setattr(worker._thread, "join", join)
    return joins
