"""The L3 server dies mid-run and comes back: the cache serves from L1/L2 meanwhile, backs off instead of
waiting on a dead socket each call, resumes L3 once the server is back, and leaves no thread stuck."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.servers import RedisServer, running
from tests.workload import make_cache, make_trace, open_work_store, serve


@pytest.fixture
def own_redis():
    """A redis-server for this test alone: killing it must not disturb the session's shared one."""
    with running(RedisServer.start) as server:
        yield server


def count_round_trips(store) -> list:
    """Record each pipeline the store opens from now on (one per round trip to the server)."""
    calls: list = []
    pipeline = store.client.pipeline

    def counting(*args, **kwargs):
        calls.append(1)
        return pipeline(*args, **kwargs)

    store.client.pipeline = counting
    return calls


def drop_l1_l2(cache) -> None:
    cache.flush()
    cache.step()
    cache.evict(cache.device_pool.num_slots)
    cache.evict_host(cache.host_pool.num_slots)


def test_redis_killed_and_restarted_mid_run(own_redis):
    threads_before = set(threading.enumerate())
    store = open_work_store(own_redis.url, {"timeout_s": 0.5, "retry_backoff_s": 0.05})
    cache = make_cache(store)
    trace = make_trace(num_requests=24, seed=5)
    for i, key in enumerate(trace):
        serve(cache, key, f"a{i}")
    cache.flush()
    cache.step()
    assert store.stats.set_pages > 0 and store.stats.errors == 0

    os.kill(own_redis.pid, signal.SIGKILL)  # by PID, mid-run
    own_redis.proc.wait(10)
    attempts = count_round_trips(store)
    calls_before = store.stats.exists_calls
    hits_while_down = sum(serve(cache, key, f"b{i}") for i, key in enumerate(trace))
    cache.flush()
    cache.step()
    assert hits_while_down > 0  # L1/L2 keep serving, every hit verified inside serve()
    assert store.stats.errors > 0
    # backoff: most calls answer at once without a round trip to the dead server
    assert 0 < len(attempts) < store.stats.exists_calls - calls_before
    cache.check_integrity()

    own_redis.restart()  # same port, empty dataset
    fresh = make_trace(num_requests=12, seed=6)
    set_before = store.stats.set_pages
    deadline = time.monotonic() + 30
    while store.stats.set_pages == set_before:  # the first calls may still fall in the backoff window
        assert time.monotonic() < deadline, "no backup reached the restarted server"
        for i, key in enumerate(fresh):
            serve(cache, key, f"c{i}")
        cache.flush()
        cache.step()
    assert store.read_backoff.ready() and store.write_backoff.ready()  # reconnected: the last round trip succeeded

    drop_l1_l2(cache)
    storage_hits_before = cache.stats.storage_hit_tokens
    for i, key in enumerate(fresh):
        serve(cache, key, f"d{i}")
    assert cache.stats.storage_hit_tokens > storage_hits_before  # L3 in use again
    cache.check_integrity()

    cache.close()
    store.close()
    # only this test's threads: a cache another test left open in this process keeps its own
    for thread in set(threading.enumerate()) - threads_before:
        thread.join(timeout=60)
    assert not set(threading.enumerate()) - threads_before, [t.name for t in threading.enumerate()]
