"""Helpers for the L3 controller tests: small caches, KV writers, and a fault-injecting page store."""

from __future__ import annotations

import threading
import time

import torch

from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools.kv import DeviceKVPool
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey
from tierkv.storage.base import PageStore
from tierkv.storage.config import StorageConfig

SPECS = {
    "mha": KVSpec(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16),
    "mla": KVSpec(num_layers=2, attention="mla", kv_lora_rank=12, rope_dim=4, dtype=torch.bfloat16),
}


class FakeStore(PageStore):
    """A dict of pages. ``fail`` raises in every call, ``hang`` blocks calls until released, ``corrupt``
    names keys whose reads fail verification, ``blobs`` may be shared to act as the same store."""

    name = "fake"

    def __init__(self, namespace: str, page_nbytes: int, blobs: dict | None = None) -> None:
        super().__init__(namespace, page_nbytes)
        self.blobs = {} if blobs is None else blobs
        self.fail = False
        self.hang = threading.Event()
        self.hang.set()  # set: calls pass; clear: calls block until set again
        self.corrupt: set[str] = set()
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def _enter(self, op: str) -> None:
        with self.lock:
            self.calls.append(op)
        self.hang.wait()
        if self.fail:
            raise ConnectionError(f"fake store: {op} failed")

    def wait_for_calls(self, num_calls: int, timeout_s: float = 10.0) -> None:
        """Block until ``num_calls`` calls have entered the store (a worker is now inside it)."""
        deadline = time.monotonic() + timeout_s
        while len(self.calls) < num_calls:
            assert time.monotonic() < deadline, f"only {len(self.calls)} store calls"
            time.sleep(0.001)

    def batch_exists(self, keys: list[str]) -> int:
        self._enter("exists")
        for i, key in enumerate(keys):
            if key not in self.blobs:
                return i
        return len(keys)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        self._enter("get")
        ok = []
        for key, target in zip(keys, targets):
            blob = self.blobs.get(key)
            good = blob is not None and key not in self.corrupt
            if good:
                target.copy_(blob)
            ok.append(good)
        return ok

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        self._enter("set")
        for key, value in zip(keys, values):
            assert value.dtype == torch.uint8 and value.numel() == self.page_nbytes
            self.blobs[key] = value.clone()
        return [True] * len(keys)

    def clear(self) -> None:
        self.blobs.clear()


def make_cache(attention: str = "mha", page_size: int = 16, device_tokens: int = 512,
               host_layout: str = "page_first", **config) -> HiRadixCache:
    spec = SPECS[attention]
    pool = DeviceKVPool(spec, device_tokens, page_size, "cpu")
    return HiRadixCache(pool, CacheConfig(page_size=page_size, host_layout=host_layout, **config))


def storage_config(**overrides) -> StorageConfig:
    values = dict(prefetch_threshold=0, io_wait_timeout_s=5.0)
    values.update(overrides)
    return StorageConfig(**values)


def attach_fake(cache: HiRadixCache, blobs: dict | None = None, **overrides) -> FakeStore:
    store = FakeStore("test-ns", cache.host_pool.page_nbytes, blobs)
    cache.attach_storage(store, storage_config(**overrides), "test-model")
    return store


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (num_tokens,), generator=gen).tolist()


def compute_and_insert(cache: HiRadixCache, key: RadixKey, seed: int, kv: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Play a request's prefill: write KV (``kv`` or random) for all of ``key`` into L1, insert it."""
    spec, pool = cache.device_pool.spec, cache.device_pool
    num_tokens = len(cache.tree.elements(key))  # one fewer than the ids in bigram mode
    slots = cache.alloc_device(num_tokens)
    assert slots is not None
    if kv is None:
        gen = torch.Generator().manual_seed(seed)
        kv = torch.randn(spec.num_kv, spec.num_layers, num_tokens, spec.heads, spec.dim,
                         generator=gen).to(spec.dtype)
    pool.write_tokens(slots, kv)
    owned = cache.insert(key, slots)
    assert owned == num_tokens
    return kv


def drop_l1_l2(cache: HiRadixCache) -> None:
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    cache.evict_host(cache.host_pool.num_slots)
    assert not list(cache.tree.nodes())


def fetch_and_load(cache: HiRadixCache, key: RadixKey, request_id: str = "r") -> tuple[bool, torch.Tensor]:
    """Prefetch ``key`` from L3, let it finish, load the hit into L1; (started, KV of the device hit)."""
    m = cache.match_prefix(key)
    started = cache.prefetch_from_storage(request_id, m.last_host_node, key)
    cache.flush()
    assert cache.check_prefetch_progress(request_id)
    return started, load_hit(cache, key)


def load_hit(cache: HiRadixCache, key: RadixKey) -> torch.Tensor:
    """Match ``key``, load its L2 part into L1 and return the KV of the whole hit (read from L1)."""
    m = cache.match_prefix(key)
    result = cache.init_load_back(m.last_host_node)
    if result.pending is not None:
        assert result.pending.wait()
    cache.flush()
    indices = result.device_indices
    if len(indices) == 0:
        spec = cache.device_pool.spec
        return torch.empty(spec.num_kv, spec.num_layers, 0, spec.heads, spec.dim, dtype=spec.dtype)
    return cache.device_pool.read_tokens(indices)
