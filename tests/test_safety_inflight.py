"""In-flight work outlives reset/timeouts safely, and one failing retirement strands nothing else.

Issue 11, items 1 (a host slot handed to an L3 worker stays owned until the worker returns), 5 (step()
retires every finished item even when retiring one raises) and 9 (the seed cache is bounded).
"""

import threading

import pytest
import torch

from tests.storage_util import (FakeStore, compute_and_insert, drop_l1_l2, fetch_and_load, load_hit,
                                make_cache, random_tokens, storage_config)
from tierkv.radix import RadixKey
from tierkv.cache.l3 import controller as controller_module

PS = 16
KEY_PAGES = 8


class GatedStore(FakeStore):
    """A FakeStore whose calls of one kind ("exists", "get", "set") block while that kind's gate is shut."""

    def __init__(self, namespace: str, page_nbytes: int, blobs: dict | None = None) -> None:
        super().__init__(namespace, page_nbytes, blobs)
        self.gates = {op: threading.Event() for op in ("exists", "get", "set")}
        self.entered = {op: threading.Event() for op in self.gates}
        for gate in self.gates.values():
            gate.set()

    def _enter(self, op: str) -> None:
        super()._enter(op)
        self.entered[op].set()
        assert self.gates[op].wait(30), f"gate {op} never opened"


def _gated_cache(blobs: dict | None = None):
    """L1 of 8 pages and L2 of 16: after a reset, two prompts of 8 pages reuse the stuck worker's host
    pages unless they stay owned. Waits for L3 I/O give up after 50 ms."""
    cache = make_cache(page_size=PS, device_tokens=8 * PS, tier_mode="inclusive")
    assert cache.host_pool.num_pages == 16
    store = GatedStore("test-ns", cache.host_pool.page_nbytes, blobs)
    cache.attach_storage(store, storage_config(io_wait_timeout_s=0.05, prefetch_max_tokens_in_flight=16 * PS),
                         "test-model")
    return cache, store


def _key(seed: int) -> RadixKey:
    return RadixKey(random_tokens(KEY_PAGES * PS, seed=seed))


def _assert_exact_hit(cache, key: RadixKey, kv: torch.Tensor) -> int:
    """Evict L1, load ``key``'s hit back from L2 and compare it with the KV inserted; the hit length."""
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    got = load_hit(cache, key)
    assert torch.equal(got, kv[:, :, :got.shape[2]])
    return got.shape[2]


def _open_and_retire(cache, store, gate: str, worker_done) -> None:
    """Let the stuck worker return; the next steps retire it: nothing stays drained, nothing leaks."""
    store.gates[gate].set()
    assert worker_done.wait(10)
    cache.flush()
    cache.check_integrity()
    assert not cache.storage.draining


def _start_reads(cache, prefetch, gate: str) -> None:
    """For a stuck get: let the lookup finish and a step grant the prefetch its slots, so it reads."""
    if gate == "get":
        assert prefetch.exists_done.wait(10)
        cache.step()
        assert len(prefetch.host_pages) == KEY_PAGES


@pytest.mark.parametrize("gate", ["exists", "get"])
def test_reset_during_stuck_prefetch_keeps_its_host_slots(gate):
    cache, store = _gated_cache()
    key1 = _key(1)
    compute_and_insert(cache, key1, seed=2)
    cache.flush()
    drop_l1_l2(cache)
    store.gates[gate].clear()
    m = cache.match_prefix(key1)
    assert cache.prefetch_from_storage("r1", m.last_host_node, key1)
    prefetch = cache.storage.prefetches["r1"]
    _start_reads(cache, prefetch, gate)
    assert store.entered[gate].wait(10)
    cache.reset()  # flush gives up after io_wait_timeout_s: the worker is still inside the store
    held = torch.tensor(prefetch.host_pages, dtype=torch.int64)  # none when stuck in the lookup
    assert cache.host_pool.allocator.owned_mask()[held].all()  # still owned by the stuck worker
    cache.check_integrity()
    # two prompts fill L2 again while the worker is stuck
    key2, key3 = _key(3), _key(4)
    kv2 = compute_and_insert(cache, key2, seed=5)
    cache.flush()  # retires key2's write: its L1 pages may go for key3's
    kv3 = compute_and_insert(cache, key3, seed=6)
    cache.flush()
    cache.check_integrity()
    _open_and_retire(cache, store, gate, prefetch.finished)
    _assert_exact_hit(cache, key2, kv2)
    _assert_exact_hit(cache, key3, kv3)
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("gate", ["exists", "set"])
def test_reset_during_stuck_backup_never_poisons_l3(gate):
    cache, store = _gated_cache()
    store.gates[gate].clear()
    key1 = _key(1)
    kv1 = compute_and_insert(cache, key1, seed=2)
    cache.step()  # the write to L2 retires and starts the backup to L3
    backup = cache.storage.backups[0]
    assert store.entered[gate].wait(10)
    cache.reset()
    cache.check_integrity()
    key2 = _key(3)
    kv2 = compute_and_insert(cache, key2, seed=5)
    cache.step()
    cache.check_integrity()
    _open_and_retire(cache, store, gate, backup.done)
    _assert_exact_hit(cache, key2, kv2)
    cache.close()
    # another process reading key1 from the shared L3 gets key1's KV or a miss, never key2's
    reader, _ = _gated_cache(blobs=store.blobs)
    _, got = fetch_and_load(reader, key1)
    assert torch.equal(got, kv1[:, :, :got.shape[2]])
    if gate == "set":  # the worker kept its slots: it stored key1's own pages
        assert got.shape[2] == len(key1)
    reader.check_integrity()
    reader.close()


class OneCallAtATimeStore(FakeStore):
    """A FakeStore where two calls of the backup worker block, each until its ``releases[n]`` is set: its
    first call of ``op``, then its next call of any kind (two backups, stuck one after the other)."""

    def __init__(self, namespace: str, page_nbytes: int, op: str) -> None:
        super().__init__(namespace, page_nbytes)
        self.op, self.num_calls = op, 0
        self.releases = [threading.Event() for _ in range(2)]
        self.entered = [threading.Event() for _ in range(2)]

    def _enter(self, op: str) -> None:
        super()._enter(op)
        backup_worker = threading.current_thread().name == "tierkv-backup"
        if backup_worker and (self.num_calls == 1 or self.num_calls == 0 and op == self.op):
            call, self.num_calls = self.num_calls, self.num_calls + 1
            self.entered[call].set()
            assert self.releases[call].wait(30), f"{op} call {call} never released"


@pytest.mark.parametrize("op", ["exists", "set"])
def test_reset_during_sibling_backups_gives_their_shared_slots_one_owner(op):
    """Two backups of sibling prompts both cover their shared prefix's L2 slots. A reset while both are
    stuck must leave each slot one owner, freed once, after the last of them returns: never freed under
    a node that reused it meanwhile. Prefetches keep working meanwhile."""
    cache = make_cache(page_size=PS, device_tokens=8 * PS, tier_mode="inclusive")
    store = OneCallAtATimeStore("test-ns", cache.host_pool.page_nbytes, op)
    cache.attach_storage(store, storage_config(io_wait_timeout_s=0.05, prefetch_max_tokens_in_flight=16 * PS),
                         "test-model")
    prefix = random_tokens(4 * PS, seed=1)
    siblings = [RadixKey(prefix + random_tokens(2 * PS, seed=s)) for s in (2, 3)]
    for i, key in enumerate(siblings):
        compute_and_insert(cache, key, seed=10 + i)
        cache.step()  # the write to L2 retires and starts the key's backup to L3
    first, second = cache.storage.backups
    assert len(first.host_slots) == len(second.host_slots) == 6 * PS
    assert torch.equal(first.host_slots[:4 * PS], second.host_slots[:4 * PS])  # the shared prefix
    assert store.entered[0].wait(10)
    cache.reset()  # both backups are still in flight: one inside the store, one queued behind it
    cache.check_integrity()
    key = _key(7)  # a prefetch after the reset (drained backups are no prefetch for the rate limit)
    assert cache.prefetch_from_storage("r", cache.match_prefix(key).last_host_node, key)
    store.releases[0].set()  # the first returns; the second enters the store and sticks there
    assert first.done.wait(10) and store.entered[1].wait(10)
    cache.flush()
    assert cache.check_prefetch_progress("r")  # L3 holds nothing of it
    cache.check_integrity()
    shared = first.host_slots
    assert cache.host_pool.allocator.owned_mask()[cache.host_pool.allocator.slots_to_pages(shared)].all()
    key2, key3 = _key(4), _key(5)  # fill L2 again while the second backup is stuck
    kv2 = compute_and_insert(cache, key2, seed=5)
    cache.flush()
    kv3 = compute_and_insert(cache, key3, seed=6)
    cache.flush()
    cache.check_integrity()
    store.releases[1].set()
    assert second.done.wait(10)
    cache.flush()  # the slots go back once, now that no worker can read them
    cache.check_integrity()
    assert not cache.storage.draining
    _assert_exact_hit(cache, key2, kv2)
    _assert_exact_hit(cache, key3, kv3)
    cache.reset()
    assert cache.host_pool.allocator.num_free_slots == cache.host_pool.num_slots
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("gate", ["exists", "get"])
def test_release_and_timeout_of_stuck_prefetch_keep_slots_until_it_returns(gate):
    cache, store = _gated_cache()
    key1 = _key(1)
    compute_and_insert(cache, key1, seed=2)
    cache.flush()
    drop_l1_l2(cache)
    store.gates[gate].clear()
    m = cache.match_prefix(key1)
    assert cache.prefetch_from_storage("r1", m.last_host_node, key1)
    prefetch = cache.storage.prefetches["r1"]
    _start_reads(cache, prefetch, gate)
    assert store.entered[gate].wait(10)
    cache.release_prefetch("r1")
    cache.flush()
    held = torch.tensor(prefetch.host_pages, dtype=torch.int64)
    assert cache.host_pool.allocator.owned_mask()[held].all()
    assert len(held) == (KEY_PAGES if gate == "get" else 0)  # a stuck lookup was never granted slots
    cache.check_integrity()
    store.gates[gate].set()
    assert prefetch.finished.wait(10)
    cache.flush()
    assert cache.host_pool.num_slots == cache.host_pool.allocator.num_free_slots
    cache.check_integrity()
    cache.close()


# ---- item 5: one failing retirement --------------------------------------------------------------
def _two_finished_writes(cache):
    """Two requests' write-throughs, both copied, neither retired yet; their last nodes."""
    nodes = []
    for seed in (1, 2):
        key = _key(seed)
        compute_and_insert(cache, key, seed=seed + 10)
        nodes.append(cache.match_prefix(key).last_device_node)
    cache.transfer.synchronize()
    assert all(n.lock_ref == 1 for n in nodes)  # locked by their writes
    return nodes


def test_failing_backup_start_strands_no_other_write(monkeypatch):
    cache = make_cache(page_size=PS, tier_mode="inclusive")
    cache.attach_storage(FakeStore("test-ns", cache.host_pool.page_nbytes), storage_config(), "test-model")
    first, second = _two_finished_writes(cache)
    start_backup = cache.storage.backup

    def backup(node):
        if node is first:
            raise RuntimeError("injected: cannot start this backup")
        start_backup(node)

    monkeypatch.setattr(cache.storage, "backup", backup)
    with pytest.raises(RuntimeError, match="injected"):
        cache.step()  # the error is reported once every other finished item is retired
    assert not cache.transfer.writes
    assert first.lock_ref == 0 and second.lock_ref == 0
    cache.flush()
    assert second.host_ref == 0 and first.host_ref == 0
    assert cache.storage.stats.backed_up_tokens == len(_key(2))
    cache.check_integrity()
    cache.close()


def test_failing_backup_retirement_strands_no_other_backup(monkeypatch):
    cache = make_cache(page_size=PS)
    cache.attach_storage(FakeStore("test-ns", cache.host_pool.page_nbytes), storage_config(), "test-model")
    first, second = _two_finished_writes(cache)
    cache.step()
    assert len(cache.storage.backups) == 2
    assert cache.storage.wait_idle()
    retire = cache.storage._retire_backup

    def retire_backup(backup):
        if backup.node is first:
            raise RuntimeError("injected: retirement failed")
        retire(backup)

    monkeypatch.setattr(cache.storage, "_retire_backup", retire_backup)
    with pytest.raises(RuntimeError, match="injected"):
        cache.step()
    assert not cache.storage.backups
    assert second.host_ref == 0
    assert cache.storage.stats.backed_up_tokens == len(_key(2))
    cache.close()


def test_failing_prefetch_insert_releases_its_anchor_and_slots(monkeypatch):
    cache = make_cache(page_size=PS)
    cache.attach_storage(FakeStore("test-ns", cache.host_pool.page_nbytes), storage_config(), "test-model")
    head, key = _key(1), _key(2)
    key = RadixKey(list(head.token_ids) + list(key.token_ids))
    compute_and_insert(cache, key, seed=3)
    cache.flush()
    drop_l1_l2(cache)
    compute_and_insert(cache, head, seed=4)  # the anchor: in L2, the prefetch extends it
    cache.flush()
    m = cache.match_prefix(key)
    anchor = m.last_host_node
    assert cache.prefetch_from_storage("r", anchor, key)
    cache.flush()
    assert anchor.host_ref == 1

    def insert(prefetch, num_tokens):
        raise RuntimeError("injected: insert failed")

    monkeypatch.setattr(cache.storage, "_insert", insert)
    with pytest.raises(RuntimeError, match="injected"):
        cache.check_prefetch_progress("r")
    assert anchor.host_ref == 0
    cache.flush()
    cache.check_integrity()
    cache.close()


# ---- item 9: bounded seed cache -------------------------------------------------------------------
def test_seed_cache_is_bounded_and_evicted_seeds_recompute_alike(monkeypatch):
    monkeypatch.setattr(controller_module, "MAX_CACHED_SEEDS", 4)
    cache = make_cache(page_size=PS)
    store = FakeStore("test-ns", cache.host_pool.page_nbytes)
    cache.attach_storage(store, storage_config(), "test-model")
    tokens = random_tokens(2 * PS, seed=1)
    kvs = {}
    for i in range(12):  # one tenant per extra key, each backed up to L3
        kvs[i] = compute_and_insert(cache, RadixKey(tokens, f"tenant-{i}"), seed=100 + i)
        cache.flush()
        assert cache.storage._seed.cache_info().currsize <= 4
    drop_l1_l2(cache)
    for i in (0, 11):  # tenant 0's seed was evicted long ago: recomputed, it names the same pages
        _, got = fetch_and_load(cache, RadixKey(tokens, f"tenant-{i}"), request_id=f"r{i}")
        assert torch.equal(got, kvs[i])
    cache.check_integrity()
    cache.close()
