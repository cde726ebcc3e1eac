"""The fault-injection wrapper: each fault kind does what it says, is counted, and never yields wrong bytes."""

from __future__ import annotations

import random
import threading
import uuid

import pytest
import torch

from tests.workload import WORK_PAGE, WORK_SPEC, make_cache, make_trace, open_work_store, run_workload, serve
from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool
from tierkv.storage.factory import open_store
from tierkv.storage.faults import FAULT_KINDS, FaultConfig, FaultyStore, InjectedFault
from tierkv.storage.page_format import HEADER_SIZE

PAGE_NBYTES = 256


def key(i: int) -> str:
    return f"{i:032x}"


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE_NBYTES,), i % 251, dtype=torch.uint8)


def faulty(**faults) -> FaultyStore:
    return open_store("memory", "ns", PAGE_NBYTES, {"faults": faults})


def test_clean_wrapper_round_trips_and_counts_nothing():
    store = faulty()
    keys = [key(i) for i in range(8)]
    assert store.batch_set(keys, [page(i) for i in range(8)]) == [True] * 8
    assert store.inner.page_nbytes == PAGE_NBYTES + HEADER_SIZE
    assert store.batch_exists(keys + [key(99)]) == 8
    targets = [torch.zeros(PAGE_NBYTES, dtype=torch.uint8) for _ in keys]
    assert store.batch_get(keys, targets) == [True] * 8
    assert all(torch.equal(t, page(i)) for i, t in enumerate(targets))
    assert store.injected == dict.fromkeys(FAULT_KINDS, 0)
    assert store.stats.get_pages == 8 and store.stats.set_pages == 8


@pytest.mark.parametrize("raw, field", [
    ({"error_rate": 1.5}, "error_rate"), ({"hang_s": -1}, "hang_s"), ({"latency_s": float("inf")}, "latency_s"),
    ({"partial_rate": "0.1"}, "partial_rate"), ({"corrupt_get_rate": True}, "corrupt_get_rate"),
    ({"seed": 1.0}, "seed"), ({"operations": ["get", "put"]}, "operations"), ({"operations": "get"}, "operations"),
    ({"eror_rate": 0.1}, "eror_rate"), ({"error_rate": float("nan")}, "error_rate"),
])
def test_config_rejects_bad_keys_and_values_by_name(raw, field):
    with pytest.raises(ValueError, match=field):
        FaultConfig.from_dict(raw)


def test_config_must_be_an_object():
    with pytest.raises(ValueError, match="faults must be a JSON object"):
        FaultConfig.from_dict([("error_rate", 0.1)])


def test_errors_raise_a_connection_error_and_are_counted():
    store = faulty(error_rate=1.0, operations=["set"])
    with pytest.raises(InjectedFault):
        store.batch_set([key(0xA)], [page(1)])
    assert store.batch_exists([key(0xA)]) == 0  # exists is not in operations, so it still answers
    assert store.injected["error"] == 1 and store.stats.errors == 1


def test_partial_batches_succeed_only_on_a_prefix():
    store = faulty(partial_rate=1.0, operations=["set"], seed=3)
    keys = [key(i) for i in range(16)]
    results = store.batch_set(keys, [page(i) for i in range(16)])
    done = results.index(False)
    assert results == [True] * done + [False] * (16 - done)
    assert store.batch_exists(keys) == done
    assert store.injected["partial"] == 1


def test_partial_gets_leave_the_tail_a_miss():
    store = faulty(partial_rate=1.0, operations=["get"], seed=5)
    keys = [key(i) for i in range(16)]
    store.batch_set(keys, [page(i) for i in range(16)])
    targets = [torch.zeros(PAGE_NBYTES, dtype=torch.uint8) for _ in keys]
    results = store.batch_get(keys, targets)
    done = results.index(False)
    assert results == [True] * done + [False] * (16 - done)
    assert all(torch.equal(targets[i], page(i)) for i in range(done))


@pytest.mark.parametrize("kind", ["corrupt_get", "corrupt_set"])
def test_corruption_is_a_miss_never_wrong_bytes(kind):
    store = faulty(**{f"{kind}_rate": 0.5, "seed": 11})
    keys = [key(i) for i in range(200)]
    store.batch_set(keys, [page(i) for i in range(200)])
    targets = [torch.zeros(PAGE_NBYTES, dtype=torch.uint8) for _ in keys]
    results = store.batch_get(keys, targets)
    hits = [i for i, ok in enumerate(results) if ok]
    assert all(torch.equal(targets[i], page(i)) for i in hits)
    assert 0 < store.stats.corrupt_pages == store.injected[kind] < 200
    assert len(hits) == 200 - store.stats.corrupt_pages
    # a corrupt page is dropped, so a later backup can store it again
    assert store.batch_exists(keys) == min(set(range(200)) - set(hits))


def test_latency_is_injected_and_counted():
    store = faulty(latency_rate=1.0, latency_s=0.01)
    store.batch_exists([key(0xA)])
    store.batch_set([key(0xA)], [page(0)])
    assert store.injected["latency"] == 2


def test_a_hang_ends_when_the_store_closes():
    store = faulty(hang_rate=1.0, hang_s=60.0, operations=["get"])
    store.batch_set([key(0xA)], [page(0)])
    errors: list[BaseException] = []

    def reader():
        try:
            store.batch_get([key(0xA)], [torch.zeros(PAGE_NBYTES, dtype=torch.uint8)])
        except InjectedFault as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(timeout=0.2)
    assert thread.is_alive()  # hanging
    store.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and len(errors) == 1
    assert store.injected["hang"] == 1


def test_same_seed_same_faults():
    def run(seed):
        store = faulty(error_rate=0.3, partial_rate=0.3, corrupt_get_rate=0.2, seed=seed)
        outcomes = []
        for i in range(50):
            try:
                outcomes.append(tuple(store.batch_set([key(i), key(1000 + i)], [page(i), page(i + 1)])))
            except InjectedFault:
                outcomes.append("error")
        return outcomes, dict(store.injected)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_repr_names_the_inner_store_and_the_config():
    text = repr(faulty(error_rate=0.25))
    assert "error_rate=0.25" in text and "FaultyStore" in text


# ---- a replay-like workload through L1 -> L2 -> L3 with each fault kind, over real backends ---------------
FAULTS = {
    "latency": {"latency_rate": 1.0, "latency_s": 0.002},
    "error": {"error_rate": 0.3},
    "hang": {"hang_rate": 0.1, "hang_s": 0.5},
    "partial": {"partial_rate": 0.5},
    "corrupt_get": {"corrupt_get_rate": 0.3},
    "corrupt_set": {"corrupt_set_rate": 0.3},
}



@pytest.fixture(params=["memory", "file", "redis"])
def backend(request, tmp_path):
    if request.param == "memory":
        return "memory", {}
    if request.param == "file":
        return f"file://{tmp_path}/l3", {}
    server = request.getfixturevalue("redis_server")
    return server.url, {"key_prefix": f"faults-{uuid.uuid4().hex[:8]}:", "timeout_s": 1.0, "retry_backoff_s": 0.05}


def finish(cache: HiRadixCache, store, threads_before: set[threading.Thread]) -> None:
    """Close everything and check that no thread this test started is left behind (joined with a timeout;
    threads other tests left are not ours to wait for)."""
    cache.close()
    store.close()  # wakes an injected hang the cache's bounded close did not wait for
    for thread in set(threading.enumerate()) - threads_before:
        if thread.name.startswith("tierkv-"):
            thread.join(timeout=60)  # a bound on being stuck: a loaded machine drains slowly
    left = [t.name for t in set(threading.enumerate()) - threads_before]
    assert not left, left


def test_workload_without_faults_uses_l3(backend):
    before = set(threading.enumerate())
    store = open_work_store(*backend)
    result, cache = run_workload(store, make_trace(), io_wait_timeout_s=30.0)  # no fault: let backups land
    assert result.requests == 72 and result.storage_hit_tokens > 0
    finish(cache, store, before)


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_workload_with_faults_never_returns_wrong_kv(backend, kind):
    before = set(threading.enumerate())
    store = open_work_store(*backend, faults={**FAULTS[kind], "seed": 1})
    # a hang must not hold the request: the timeout stop policy lets it go without L3
    policy = "timeout" if kind == "hang" else "wait_complete"
    result, cache = run_workload(store, make_trace(), prefetch_stop_policy=policy)
    assert result.requests == 72  # every request finished, each hit verified byte for byte in serve()
    assert store.injected[kind] > 0  # the faults happened and are counted
    if kind == "corrupt_get":
        assert store.stats.corrupt_pages == store.injected[kind]
    if kind == "corrupt_set":
        assert store.stats.corrupt_pages > 0
    if kind == "error":
        assert store.stats.errors >= store.injected["error"]
    finish(cache, store, before)


def test_disk_full_is_a_failed_write_not_a_crash(tmp_path, monkeypatch):
    import errno

    import tierkv.storage.file as file_backend

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("tierkv.storage.file_write.write_all", no_space)
    monkeypatch.setattr(file_backend.native, "pageio", None)  # the Python loop, whose writes this test breaks
    before = set(threading.enumerate())
    store = open_work_store(f"file://{tmp_path}/l3", {})
    result, cache = run_workload(store, make_trace(num_requests=16))
    assert result.requests == 32 and result.hit_tokens > 0  # L1/L2 still serve, every hit verified
    assert store.stats.set_pages == 0 and store.stats.errors > 0
    assert cache.storage.stats.backup_failed_pages > 0
    assert not list((tmp_path / "l3").rglob("*.tmp"))  # no half-written temp files left behind
    finish(cache, store, before)


def test_l1_l2_copy_failures_degrade_to_recompute():
    """A failing L1<->L2 copy (a bad DMA, say) drops that copy's slots; hits stay exact, nothing leaks."""
    rng = random.Random(3)

    def flaky_copy(kind: str) -> None:
        if rng.random() < 0.3:
            raise RuntimeError(f"injected {kind} copy failure")

    before = set(threading.enumerate())
    store = open_work_store("memory", {})
    cache = make_cache(store)
    cache.transfer.delay_hook = flaky_copy
    hits = sum(serve(cache, key, f"r{i}") for i, key in enumerate(make_trace(num_requests=24) * 2))
    cache.flush()
    cache.step()
    cache.check_integrity()
    assert hits > 0 and cache.stats.failed_copies > 0
    finish(cache, store, before)


def test_faults_come_from_the_storage_extra_config_json():
    from tierkv.cache.l3.controller import open_storage

    cache = HiRadixCache(DeviceKVPool(WORK_SPEC, 64, WORK_PAGE, "cpu"), CacheConfig(page_size=WORK_PAGE))
    with pytest.raises(ValueError, match="eror_rate"):
        open_storage(cache, "memory", '{"faults": {"eror_rate": 0.5}}', "m")
    controller = open_storage(cache, "memory", '{"faults": {"error_rate": 0.5, "seed": 2}, "prefetch_threshold": 0}',
                              "m")
    assert isinstance(controller.store, FaultyStore) and controller.store.config.error_rate == 0.5
    cache.close()


@pytest.mark.parametrize("kind", ["error", "partial", "corrupt_get", "corrupt_set"])
def test_real_replay_with_faults_keeps_exact_kv_and_accounting(tmp_path, monkeypatch, kind):
    """`tierkv replay`'s own driver (with --verify: every reused prefix's KV checked) over a faulty L3."""
    import json
    from pathlib import Path

    import tierkv.replay.replay as replay_module
    from tierkv.replay.replay import ReplayConfig, replay
    from tierkv.replay.trace import load_trace
    from tests.test_replay import reference_hits

    from tierkv.cache.l3.controller import open_storage

    stores = []

    def open_faulty_storage(cache, spec, extra, namespace):
        values = {**json.loads(extra), "faults": {**FAULTS[kind], "seed": 4}}
        controller = open_storage(cache, spec, json.dumps(values), namespace)
        stores.append(controller.store)
        return controller

    monkeypatch.setattr(replay_module, "open_storage", open_faulty_storage)
    requests = load_trace(Path(__file__).parent / "fixtures" / "conversation_200.jsonl", limit=60).requests
    result = replay(requests, ReplayConfig(l1_tokens=8_192, l2_tokens=16_384, l3="memory", verify=True))
    assert len(result.requests) == len(requests) and result.uncached_requests == 0
    assert result.prefetched_l3_l2_tokens == result.tier_hits()["l3"] > 0  # L3 hits are what L3 delivered
    unbounded = reference_hits(requests, page_size=16)
    assert all(r.hit_tokens <= bound for r, bound in zip(result.requests, unbounded))
    assert stores[0].injected[kind] > 0
