"""L3 on a real 3-master Redis Cluster (issue 15, item 7): slots spread pages, a killed master costs hits."""

import os
import signal

import pytest
import redis
import torch

from tests.servers import RedisClusterServers, running
from tests.test_storage_backends import PAGE_NBYTES, empty_pages, make_keys, make_pages
from tierkv.storage.factory import open_store


@pytest.fixture(scope="module")
def redis_cluster():
    with running(RedisClusterServers.start) as cluster:
        yield cluster


def test_cluster_round_trip_spreads_pages_over_every_master(redis_cluster):
    import redis
    store = open_store(redis_cluster.url, "ns", PAGE_NBYTES, {"key_prefix": "rt:", "ttl_s": 600})
    keys, pages = make_keys(40), make_pages(40)
    assert store.batch_set(keys, pages) == [True] * 40
    assert store.batch_exists(keys) == 40
    targets = empty_pages(40)
    assert store.batch_get(keys, targets) == [True] * 40
    assert all(torch.equal(t, p) for t, p in zip(targets, pages))
    per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes]
    assert all(count > 0 for count in per_node) and sum(per_node) == 40
    store.clear()
    assert store.batch_exists(keys) == 0 and sum(redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes) == 0
    store.close()


def test_cluster_takes_copy_digests_and_a_wrong_one_is_a_miss(redis_cluster):
    """Backups hand the L1 -> L2 copy's digests to the cluster store as to a single Redis: headers filled
    from them (a digest of None hashed here), each page read back exact, a wrong digest a counted miss."""
    import xxhash
    store = open_store(redis_cluster.url, "ns", PAGE_NBYTES, {"key_prefix": "dg:", "ttl_s": 600})
    assert store.accepts_digests
    keys, pages = make_keys(12, seed=4), make_pages(12, seed=4)
    digests = [xxhash.xxh3_64_intdigest(p.numpy().tobytes()) for p in pages]
    given = digests[:5] + [None] + digests[6:]
    given[9] ^= 1
    assert store.batch_set(keys, pages, digests=given) == [True] * 12
    targets = empty_pages(12)
    assert store.batch_get(keys, targets) == [i != 9 for i in range(12)]
    assert all(torch.equal(t, p) for i, (t, p) in enumerate(zip(targets, pages)) if i != 9)
    assert store.stats.corrupt_pages == 1
    store.clear()
    store.close()


def test_a_dead_master_costs_only_its_own_pages_in_every_batch(redis_cluster):
    """Whole batches (as prefetch and backup send them) with one master killed by PID: every page on
    the two live masters still hits, in the batch that meets the dead master and in the next ones, and
    only the dead master's pages miss or fail to write. (Runs before the test below kills another.)"""
    store = open_store(redis_cluster.url, "ns", PAGE_NBYTES, {"key_prefix": "dead:", "timeout_s": 1.0,
                                                              "retry_backoff_s": 30.0, "batch_pages": 4})
    keys, pages = make_keys(60, seed=5), make_pages(60, seed=5)
    assert store.batch_set(keys, pages) == [True] * 60
    victim = redis_cluster.nodes[1]
    slot_map = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    on_victim = [slot_map.get_node_from_key(store.redis_key(k)).port == victim.port for k in keys]
    slot_map.close()
    assert 0 < sum(on_victim) < 60
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait(10)
    try:
        for _ in range(3):  # the first batch meets the dead master, the next ones find it backing off
            targets = empty_pages(60)
            assert store.batch_get(keys, targets) == [not dead for dead in on_victim]
            assert all(torch.equal(t, p) for t, p, dead in zip(targets, pages, on_victim) if not dead)
        live_keys = [k for k, dead in zip(keys, on_victim) if not dead]
        assert store.batch_exists(live_keys) == len(live_keys)
        assert store.batch_exists(keys) == on_victim.index(True)  # the leading run stops at its first page
        assert store.batch_set(keys, pages) == [not dead for dead in on_victim]
        assert store.stats.errors > 0
    finally:
        victim.restart()  # same port and nodes.conf: it rejoins with its slots (and no data)
        redis_cluster.wait_ok("redis-cli")
        store.close()


def test_cluster_master_killed_mid_run_costs_hits_never_correctness(redis_cluster):
    store = open_store(redis_cluster.url, "ns", PAGE_NBYTES,
                       {"key_prefix": "kill:", "timeout_s": 1.0, "retry_backoff_s": 0.01, "batch_pages": 1})
    keys, pages = make_keys(30, seed=3), make_pages(30, seed=3)
    assert store.batch_set(keys, pages) == [True] * 30
    redis_cluster.nodes[2].kill()
    found, targets = [], empty_pages(30)
    for i, key in enumerate(keys):
        # One page per call, each outside any backoff window (a failure opens one; here we look at
        # what each master answers, not at how long the store waits before asking again).
        store.read_backoff.succeeded()
        store.write_backoff.succeeded()
        found += store.batch_get([key], targets[i:i + 1])
    assert 0 < sum(found) < 30 and store.stats.errors > 0  # the dead master's pages are misses
    assert all(torch.equal(t, p) for t, p, ok in zip(targets, pages, found) if ok)  # every hit exact
    store.write_backoff.succeeded()
    written = store.batch_set(keys, pages)  # refused or failed for the dead slots; never raises
    assert not all(written)
    store.close()


def test_unreachable_cluster_is_a_counted_miss_not_an_error_at_open():
    from tests.servers import free_port
    store = open_store(f"redis+cluster://127.0.0.1:{free_port()}", "ns", PAGE_NBYTES,
                       {"timeout_s": 0.5, "retry_backoff_s": 30.0})
    keys, pages = make_keys(2), make_pages(2)
    assert store.batch_exists(keys) == 0 and store.stats.errors == 1
    assert store.batch_set(keys, pages) == [False, False]  # inside the backoff: no attempt
    assert store.batch_get(keys, empty_pages(2)) == [False, False]
    with pytest.raises(ValueError, match="db"):
        open_store(f"redis+cluster://127.0.0.1:{free_port()}/3", "ns", PAGE_NBYTES)
