"""Soak test (not CI): a long run of random cache operations over small pools.

Checks integrity every ``--check-every`` operations, prints throughput and resident memory at each
checkpoint, and ends with a verdict: memory must not grow after warm-up (the first ``--warmup`` fraction).

    python bench/soak.py --ops 1000000
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tierkv.cache.config import CacheConfig  # noqa: E402
from tierkv.cache.hicache import HiRadixCache  # noqa: E402
from tierkv.pools import DeviceKVPool, KVSpec  # noqa: E402
from tierkv.radix import RadixKey  # noqa: E402

SPEC = KVSpec(num_layers=2, kv_heads=1, head_dim=4, dtype="float16")
GROWTH_LIMIT_BYTES = 8 << 20  # allocator noise; a leak of one node per op would exceed it quickly


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), falling back to the peak where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Workload:
    """Random requests over a bounded key universe: shared system prompts, tenants, multi-turn growth."""

    def __init__(self, cache: HiRadixCache, rng: random.Random) -> None:
        self.cache, self.rng = cache, rng
        self.prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 48))] for _ in range(32)]
        self.locks: list = []

    def key(self) -> RadixKey:
        rng = self.rng
        ids = rng.choice(self.prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        return RadixKey(ids, rng.choice([None, None, "tenant-a", "tenant-b"]))

    def insert(self) -> None:
        key, page = self.key(), self.cache.config.page_size
        num_slots = -(-len(key) // page) * page
        slots = self.cache.alloc_device(num_slots)
        if slots is None:
            return
        owned = self.cache.insert(key, slots)
        self.cache.device_pool.free(slots[owned:])

    def match(self) -> None:
        match = self.cache.match_prefix(self.key())
        load = self.cache.init_load_back(match.last_host_node)
        if load.pending is not None:
            load.pending.wait()
        if self.rng.random() < 0.5 and len(self.locks) < 8:
            self.cache.inc_lock_ref(load.last_node)
            self.locks.append(load.last_node)

    def unlock(self) -> None:
        if self.locks:
            self.cache.dec_lock_ref(self.locks.pop(self.rng.randrange(len(self.locks))))

    def run_one(self) -> None:
        r = self.rng.random()
        if r < 0.40:
            self.insert()
        elif r < 0.75:
            self.match()
        elif r < 0.85:
            self.unlock()
        elif r < 0.90:
            self.cache.evict(self.rng.randrange(1, 64))
        elif r < 0.93:
            self.cache.evict_host(self.rng.randrange(1, 64))
        else:
            self.cache.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--check-every", type=int, default=10_000)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of ops before the RSS baseline")
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--write-policy", default="write_through")
    parser.add_argument("--device-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = CacheConfig(page_size=args.page_size, write_policy=args.write_policy, load_back_threshold=0)
    cache = HiRadixCache(DeviceKVPool(SPEC, args.device_tokens, args.page_size, "cpu"), config)
    work = Workload(cache, random.Random(args.seed))
    warmup_ops = int(args.ops * args.warmup)
    baseline = None
    samples: list[tuple[int, int]] = []
    start = last = time.perf_counter()
    print(f"{'ops':>10} {'ops/s':>10} {'rss MiB':>9} {'nodes':>7} {'L1 used':>8} {'L2 used':>8}")
    for i in range(1, args.ops + 1):
        work.run_one()
        if i % args.check_every == 0:
            cache.flush()
            cache.check_integrity()
            now, rss = time.perf_counter(), rss_bytes()
            if i >= warmup_ops:
                baseline = baseline if baseline is not None else rss
                samples.append((i, rss))
            print(f"{i:>10} {args.check_every / (now - last):>10.0f} {rss / 2**20:>9.1f} "
                  f"{sum(1 for _ in cache.tree.nodes()):>7} {cache.device_pool.allocator.num_used_slots:>8} "
                  f"{cache.host_pool.allocator.num_used_slots:>8}")
            last = now
    elapsed = time.perf_counter() - start
    while work.locks:
        work.unlock()
    cache.flush()
    cache.check_integrity()
    cache.close()
    growth = samples[-1][1] - baseline if samples else 0
    ok = growth <= GROWTH_LIMIT_BYTES
    print(f"\n{args.ops} ops in {elapsed:.1f} s: {args.ops / elapsed:.0f} ops/s; peak RSS "
          f"{peak_rss_bytes() / 2**20:.1f} MiB; RSS after warm-up {baseline / 2**20 if baseline else 0:.1f} MiB "
          f"-> end {samples[-1][1] / 2**20 if samples else 0:.1f} MiB (growth {growth / 2**20:+.1f} MiB)")
    print(f"verdict: {'PASS' if ok else 'FAIL'} (limit {GROWTH_LIMIT_BYTES >> 20} MiB growth after warm-up; "
          f"integrity checked every {args.check_every} ops)")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
