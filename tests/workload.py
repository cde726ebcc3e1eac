"""A replay-like workload for reliability tests: requests served the way a scheduler does, with the KV of
every hit checked against the per-token pattern written at insert (a faulty page must be a miss)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from tierkv.cache.config import CacheConfig
from tierkv.hashing import HashNamespace
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool, KVSpec
from tierkv.radix import RadixKey
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import open_store

WORK_SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=2, dtype="float32")
WORK_PAGE = 4


def token_kv(ids: list[int], extra_key: str | None) -> torch.Tensor:
    """The KV a token gets at insert: a chained hash of its whole prefix (exact in float32), per layer/head."""
    h, values = hash(extra_key) % (1 << 16), []
    for t in ids:
        h = (h * 1_000_003 + t) % (1 << 18)
        values.append(h)
    base = torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1, 1)
    offsets = torch.arange(WORK_SPEC.num_kv * WORK_SPEC.num_layers * WORK_SPEC.heads * WORK_SPEC.dim,
                           dtype=torch.float32).view(WORK_SPEC.num_kv, WORK_SPEC.num_layers, 1, WORK_SPEC.heads,
                                                     WORK_SPEC.dim)
    return base * 64 + offsets  # < 2**24: every value exact


def make_trace(num_requests: int = 36, seed: int = 0) -> list[RadixKey]:
    """Mooncake-like requests: shared 16-token blocks (system prompts, earlier turns) plus a fresh tail."""
    rng = random.Random(seed)
    blocks = [[rng.randrange(30_000) for _ in range(16)] for _ in range(24)]
    trace = []
    for _ in range(num_requests):
        chain = [0] + [rng.randrange(1, 24) for _ in range(rng.randrange(1, 5))]
        ids = [t for b in chain for t in blocks[b]] + [rng.randrange(30_000) for _ in range(rng.randrange(0, 9))]
        trace.append(RadixKey(ids, rng.choice([None, "tenant-a"])))
    return trace


@dataclass
class WorkloadResult:
    requests: int = 0
    hit_tokens: int = 0
    storage_hit_tokens: int = 0


def serve(cache: HiRadixCache, key: RadixKey, rid: str) -> int:
    """One request the way a scheduler runs it; returns its verified hit tokens."""
    match = cache.match_prefix(key)
    if cache.prefetch_from_storage(rid, match.last_host_node, key):
        for _ in range(5000):  # the timeout stop policy bounds this; the bound only guards the test
            cache.step()
            if cache.check_prefetch_progress(rid):
                break
            time.sleep(0.001)
        else:
            raise AssertionError(f"request {rid} never finished its prefetch")
    match = cache.match_prefix(key)
    load = cache.init_load_back(match.last_host_node)
    hit, last_node = load.device_indices, load.last_node
    if load.pending is not None and not load.pending.wait():
        cache.flush()  # retires the failed load: the loaded nodes drop their garbage L1 slots
        match = cache.match_prefix(key)
        hit, last_node = match.device_indices, match.last_device_node
    if len(hit):  # never wrong KV: every hit token holds exactly what was written for that prefix
        assert torch.equal(cache.device_pool.read_tokens(hit), token_kv(key.token_ids[:len(hit)], key.extra_key))
    cache.inc_lock_ref(last_node)
    num_new = len(key) - len(hit)
    padded = -(-num_new // WORK_PAGE) * WORK_PAGE
    fresh = cache.alloc_device(padded) if padded else hit[:0]
    if fresh is None:  # L1 is held by copies not yet acknowledged: wait for them, as a scheduler would
        cache.flush()
        fresh = cache.alloc_device(padded)
    assert fresh is not None, "L1 has no room even after eviction"
    ids = list(key.token_ids) + [0] * (padded - num_new)
    if padded:
        cache.device_pool.write_tokens(fresh, token_kv(ids, key.extra_key)[:, :, len(hit):])
    owned = cache.insert(key, torch.cat([hit, fresh]))
    cache.dec_lock_ref(last_node)
    cache.device_pool.free(torch.cat([hit, fresh])[owned:])
    cache.step()
    cache.check_integrity()
    return len(hit)


def make_cache(store, **storage_overrides) -> HiRadixCache:
    """A small L1/L2 cache with ``store`` attached as L3 (prefetch stop policy: wait_complete by default)."""
    cache = HiRadixCache(DeviceKVPool(WORK_SPEC, 160, WORK_PAGE, "cpu"),
                         CacheConfig(page_size=WORK_PAGE, host_layout="page_first", load_back_threshold=0,
                                     hicache_ratio=2.0))
    ns = work_namespace()
    settings = dict(prefetch_threshold=0, prefetch_stop_policy="wait_complete", prefetch_timeout_base=0.2,
                    prefetch_timeout_per_ki_token=0.0, io_wait_timeout_s=0.3, prefetch_batch_pages=4)
    settings.update(storage_overrides)
    cache.attach_storage(store, StorageConfig(**settings), ns)
    return cache


def run_workload(store, trace: list[RadixKey], **storage_overrides) -> tuple[WorkloadResult, HiRadixCache]:
    """Serve ``trace`` twice (the second pass finds much of the first in L3 only); every hit verified."""
    cache = make_cache(store, **storage_overrides)
    result = WorkloadResult()
    for i, key in enumerate(trace * 2):
        if i == len(trace):
            cache.flush()  # the first pass's backups land (bounded by io_wait_timeout_s) before the second
        result.hit_tokens += serve(cache, key, f"r{i}")
        result.requests += 1
    cache.flush()
    cache.step()
    cache.check_integrity()
    result.storage_hit_tokens = cache.stats.storage_hit_tokens
    return result, cache


def work_namespace() -> HashNamespace:
    return HashNamespace.for_spec("fault-model", WORK_SPEC, "page_first")


def open_work_store(spec: str, options: dict, faults: dict | None = None):
    """A store for the workload's pages; ``faults`` wraps it in fault injection."""
    page_nbytes = WORK_PAGE * WORK_SPEC.bytes_per_token
    extra = {**options, **({"faults": faults} if faults else {})}
    return open_store(spec, work_namespace().name(), page_nbytes, extra)
