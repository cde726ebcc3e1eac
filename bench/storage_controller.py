"""L3 through the cache vs the raw backend, side by side: backup (L2 -> L3) and prefetch (L3 -> L2).

Llama-3-8B-sized KV (128 KiB per token, bf16), 64-token pages (8 MiB), page_first host layout. The
baseline is one ``batch_set`` / ``batch_get`` of the same pages into the same host-pool memory on a
fresh store of the same backend; the ratio is baseline time / controller time (1.0 = no overhead).

    python bench/storage_controller.py --pages 16 --repeats 3 [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

import torch

from tierkv.cache.config import CacheConfig
from tierkv.hashing import HashNamespace
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools.kv import DeviceKVPool
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import open_store

SPEC = KVSpec(num_layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
PAGE_SIZE = 64


def _cache(num_pages: int) -> HiRadixCache:
    device = DeviceKVPool(SPEC, num_pages * PAGE_SIZE, PAGE_SIZE, "cpu")
    return HiRadixCache(device, CacheConfig(page_size=PAGE_SIZE, host_layout="page_first", hicache_ratio=2.0))


def _one_round(open_fresh, num_pages: int, kv: torch.Tensor, raw_first: bool) -> dict[str, float]:
    """Seconds for: controller backup, raw set, controller prefetch, raw get (same pages, same bytes).

    ``raw_first`` swaps the order inside each pair, so that page-cache and dirty-page effects of the
    first run do not always fall on the same side.
    """
    cache = _cache(num_pages)
    ns = HashNamespace.for_spec("bench", SPEC, "page_first")
    nbytes = cache.host_pool.page_nbytes
    cache.attach_storage(open_fresh(ns.name(), nbytes), StorageConfig(prefetch_threshold=0), ns)
    raw = open_fresh(ns.name(), nbytes)
    key = RadixKey(torch.randint(0, 100_000, (num_pages * PAGE_SIZE,)).tolist())
    slots = cache.alloc_device(len(key))
    cache.device_pool.write_tokens(slots, kv)
    cache.insert(key, slots)
    cache.transfer.synchronize()
    node = cache.match_prefix(key).last_device_node
    hashes = cache.storage.path_hashes(node)
    views = _page_views(cache, node.host_value)

    def backup() -> None:
        cache.step()  # retires the L2 write, which starts the L3 backup
        cache.storage.wait_idle(600)

    def prefetch() -> None:
        assert cache.prefetch_from_storage("bench", cache.tree.root, key)
        cache.storage.wait_idle(600)
        cache.step()
        assert cache.check_prefetch_progress("bench")

    times = _timed_pair("backup", backup, "raw_set", lambda: raw.batch_set(hashes, views), raw_first)
    cache.step()
    cache.evict(len(key))
    cache.evict_host(len(key))
    targets = cache.host_pool.alloc(len(key))
    get_views = _page_views(cache, targets)
    times.update(_timed_pair("prefetch", prefetch, "raw_get", lambda: raw.batch_get(hashes, get_views),
                             raw_first))
    assert cache.match_prefix(key).host_hit_length == len(key)
    assert torch.equal(cache.host_pool.read_tokens(targets), cache.host_pool.read_tokens(
        cache.match_prefix(key).last_host_node.host_value))
    raw.clear()
    raw.close()
    cache.close()
    return times


def _page_views(cache: HiRadixCache, slots: torch.Tensor) -> list[torch.Tensor]:
    return [cache.host_pool.page_bytes(p) for p in cache.host_pool.allocator.slots_to_pages(slots).tolist()]


def _timed_pair(name_a: str, run_a, name_b: str, run_b, b_first: bool) -> dict[str, float]:
    times = {}
    for name, run in ([(name_b, run_b), (name_a, run_a)] if b_first else [(name_a, run_a), (name_b, run_b)]):
        start = time.perf_counter()
        result = run()
        times[name] = time.perf_counter() - start
        assert result is None or all(result), f"{name} failed"
    return times


def bench_backend(name: str, open_fresh, num_pages: int, repeats: int, kv: torch.Tensor) -> list[tuple]:
    best: dict[str, float] = {}
    for i in range(repeats):
        for what, seconds in _one_round(open_fresh, num_pages, kv, raw_first=i % 2 == 1).items():
            best[what] = min(best.get(what, seconds), seconds)
    gigabytes = num_pages * PAGE_SIZE * SPEC.bytes_per_token / 1e9
    return [(name, "backup (L2->L3)", gigabytes / best["raw_set"], gigabytes / best["backup"],
             best["raw_set"] / best["backup"]),
            (name, "prefetch (L3->L2)", gigabytes / best["raw_get"], gigabytes / best["prefetch"],
             best["raw_get"] / best["prefetch"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    kv = torch.randn(SPEC.num_kv, SPEC.num_layers, args.pages * PAGE_SIZE, SPEC.heads, SPEC.dim).to(SPEC.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        backends = {"memory": lambda ns, n: open_store("memory", ns, n),
                    "file": lambda ns, n: open_store(f"file://{tmp}/{uuid.uuid4().hex}", ns, n)}
        if args.redis_url:
            backends["redis"] = lambda ns, n: open_store(args.redis_url, ns, n,
                                                         {"key_prefix": f"bench-{uuid.uuid4().hex[:8]}:"})
        for name, opener in backends.items():
            rows += bench_backend(name, opener, args.pages, args.repeats, kv)
    print(f"{'backend':8} {'direction':18} {'raw GB/s':>9} {'cache GB/s':>10} {'ratio':>6}")
    for name, direction, raw, ours, ratio in rows:
        print(f"{name:8} {direction:18} {raw:9.2f} {ours:10.2f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
