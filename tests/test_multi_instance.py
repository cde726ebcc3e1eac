"""Many servers, one L3: independent processes with their own L1/L2 share pages through file, redis, mooncake.

Which concurrent writer of one page wins is the backend's rule (see README "Many servers sharing one
L3"): file (atomic rename) and redis (one SET) keep the last complete write, mooncake (put-if-absent)
the first. Either way a reader sees one writer's whole page, never a mix, and the checksum holds.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tierkv.cache.config import CacheConfig
from tierkv.hashing import HashNamespace
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools.kv import DeviceKVPool
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey
from tierkv.cache.l3.controller import open_storage
from tierkv.storage.factory import open_store

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float16)
PAGE_SIZE = 16
LAYOUT = "page_first"
PROMPT_TOKENS = 8 * PAGE_SIZE
WRITER_PAGE_NBYTES = 32 << 10
NUM_WRITERS = 2
WINNER = {"file": "last", "redis": "last", "mooncake": "first"}
TIMEOUT_S = 60


@pytest.fixture(params=["file", "redis", "mooncake"])
def shared_l3(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str, dict]:
    """(backend, spec, backend keys) that every server process opens its own client with."""
    backend = request.param
    if backend == "file":
        return backend, f"file://{tmp_path}/l3", {}
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        return backend, server.url, {"key_prefix": f"multi-{uuid.uuid4().hex[:8]}:"}
    pytest.importorskip("tierkv.storage.mooncake_store")
    master = request.getfixturevalue("mooncake_master")
    return backend, master.url, {**master.client_config(), "key_prefix": f"multi-{uuid.uuid4().hex[:8]}:"}


def _start(fn, nprocs: int, *args) -> None:
    """Run ``fn(index, *args)`` in ``nprocs`` fresh processes (forkserver: torch is imported once)."""
    mp.set_forkserver_preload(["torch", "torch.distributed", "tierkv.cache.hicache", "tierkv.cache.l3.controller"])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def _kv_bytes_digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---- a prefix computed by one server is an L3 hit for another --------------------------------------
def _prompt_kv() -> tuple[RadixKey, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 32_000, (PROMPT_TOKENS,), generator=gen).tolist()
    kv = torch.randn(SPEC.num_kv, SPEC.num_layers, PROMPT_TOKENS, SPEC.heads, SPEC.dim, generator=gen)
    return RadixKey(tokens), kv.to(SPEC.dtype)


def _server(role: int, spec: str, backend_keys: dict, barrier, results) -> None:
    """Server 0 computes the prompt and backs it up to L3; server 1 then serves it from L3."""
    cache = HiRadixCache(DeviceKVPool(SPEC, 4 * PROMPT_TOKENS, PAGE_SIZE, "cpu"),
                         CacheConfig(page_size=PAGE_SIZE, host_layout=LAYOUT))
    extra = json.dumps({"prefetch_threshold": 0, "prefetch_stop_policy": "wait_complete", **backend_keys})
    open_storage(cache, spec, extra, HashNamespace.for_spec("multi-instance-model", SPEC, LAYOUT))
    key, kv = _prompt_kv()
    try:
        if role == 0:
            slots = cache.alloc_device(PROMPT_TOKENS)
            cache.device_pool.write_tokens(slots, kv)
            assert cache.insert(key, slots) == PROMPT_TOKENS
            cache.flush()  # write-through to L2, then the backup to L3
            assert cache.storage.stats.backed_up_tokens == PROMPT_TOKENS, cache.storage.stats
            results.put(("computed", _kv_bytes_digest(cache.device_pool.read_tokens(slots))))
            barrier.wait(TIMEOUT_S)  # the pages are in L3
        else:
            barrier.wait(TIMEOUT_S)
            m = cache.match_prefix(key)
            assert len(m.device_indices) == 0 and m.host_hit_length == 0
            assert cache.prefetch_from_storage("req", m.last_host_node, key)
            cache.flush()
            assert cache.check_prefetch_progress("req")
            assert cache.stats.storage_hit_tokens == PROMPT_TOKENS
            loaded = cache.init_load_back(cache.match_prefix(key).last_host_node)
            assert loaded.pending is not None and loaded.pending.wait()
            got = cache.device_pool.read_tokens(loaded.device_indices)
            assert torch.equal(got, kv)
            results.put(("served", _kv_bytes_digest(got)))
            cache.flush()
            cache.check_integrity()
        barrier.wait(TIMEOUT_S)  # mooncake keeps objects in the putting client's segment: stay up
    except BaseException:
        barrier.abort()
        raise
    finally:
        cache.close()


def test_prefix_computed_by_one_server_is_an_l3_hit_for_another(shared_l3: tuple[str, str, dict]) -> None:
    backend, spec, backend_keys = shared_l3
    ctx = mp.get_context("forkserver")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    _start(_server, 2, spec, backend_keys, barrier, results)
    digests = dict(results.get(timeout=TIMEOUT_S) for _ in range(2))
    assert digests["served"] == digests["computed"]
    assert digests["computed"] == _kv_bytes_digest(_prompt_kv()[1])


# ---- concurrent writers of the same pages -------------------------------------------------------------
KEYS = [hashlib.sha256(f"shared-page-{i}".encode()).hexdigest() for i in range(6)]
SEQUENTIAL_KEYS = [hashlib.sha256(f"sequential-page-{i}".encode()).hexdigest() for i in range(3)]


def _payload(writer: int, key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(writer * 1_000_003 + int(key[:8], 16))
    return torch.randint(0, 256, (WRITER_PAGE_NBYTES,), dtype=torch.uint8, generator=gen)


def _whose(key: str, page: torch.Tensor) -> int:
    """Which writer's payload ``page`` is; -1 for anything else (a torn or foreign page)."""
    return next((w for w in range(NUM_WRITERS) if torch.equal(page, _payload(w, key))), -1)


def _read_all(store, keys: list[str]) -> list[int]:
    """Owner of each page as read now (-2: missing); a torn page shows as -1."""
    targets = [torch.empty(WRITER_PAGE_NBYTES, dtype=torch.uint8) for _ in keys]
    found = store.batch_get(keys, targets)
    return [_whose(k, t) if ok else -2 for k, t, ok in zip(keys, targets, found)]


def _read_settled(store, keys: list[str]) -> list[int]:
    """Owners once every page reads back. A read may miss for a while (mooncake: a read lease that
    expired under load, then the client's backoff); a miss is a recompute, never wrong KV."""
    for _ in range(20):
        owners = _read_all(store, keys)
        if -2 not in owners:
            break
        time.sleep(0.25)
    return owners


def _peer(role: int, spec: str, backend_keys: dict, barrier, results) -> None:
    """Roles 0..NUM_WRITERS-1 write the same pages over and over; the last role reads them meanwhile."""
    store = open_store(spec, "multi-instance-writers", WRITER_PAGE_NBYTES, backend_keys)
    try:
        barrier.wait(TIMEOUT_S)
        if role < NUM_WRITERS:
            payloads = [_payload(role, k) for k in KEYS]
            for _ in range(20):
                store.batch_set(KEYS, payloads)
        else:
            seen: set[int] = set()
            for _ in range(20):
                owners = _read_all(store, KEYS)
                assert -1 not in owners, f"a reader saw a page that no writer wrote: {owners}"
                seen.update(owners)
            results.put(("seen during writes", sorted(seen)))
        barrier.wait(TIMEOUT_S)  # all writes done
        final = _read_settled(store, KEYS)
        assert all(owner in range(NUM_WRITERS) for owner in final), final
        # Then one writer after the other on fresh pages: who wins is the backend's rule.
        for writer in range(NUM_WRITERS):
            if role == writer:
                assert all(store.batch_set(SEQUENTIAL_KEYS, [_payload(writer, k) for k in SEQUENTIAL_KEYS])) \
                    or writer > 0, "the first write of a fresh page must succeed"
            barrier.wait(TIMEOUT_S)
        if role == NUM_WRITERS:
            results.put(("sequential", _read_settled(store, SEQUENTIAL_KEYS)))
            results.put(("corrupt", store.stats.corrupt_pages))
        barrier.wait(TIMEOUT_S)  # mooncake keeps objects in the putting client's segment: stay up
    except BaseException:
        barrier.abort()
        raise
    finally:
        store.close()


def test_concurrent_writers_never_corrupt_a_page(shared_l3: tuple[str, str, dict]) -> None:
    backend, spec, backend_keys = shared_l3
    ctx = mp.get_context("forkserver")
    barrier, results = ctx.Barrier(NUM_WRITERS + 1), ctx.Queue()
    _start(_peer, NUM_WRITERS + 1, spec, backend_keys, barrier, results)
    report = dict(results.get(timeout=TIMEOUT_S) for _ in range(3))
    assert report["corrupt"] == 0
    assert set(report["seen during writes"]) <= {-2, *range(NUM_WRITERS)}
    expected_owner = NUM_WRITERS - 1 if WINNER[backend] == "last" else 0
    assert report["sequential"] == [expected_owner] * len(SEQUENTIAL_KEYS)
