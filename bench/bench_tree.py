"""Tree-operation microbenchmark: match_prefix + insert + evict over prefix-sharing conversations.

Workload: a few long shared system prompts, many conversations branching from them, each turn
re-sending the whole history plus a new user message, then inserting the history plus the reply (as an
engine does after a request). L1 is sized to hold a fraction of the working set, so allocations evict.
Baseline: the same run with eviction as it was before the persistent heap, a heap built over the whole
leaf frontier on every ``evict()`` call. Times are this thread's CPU time (the machine may be shared);
baseline and measured run in one process.

    python bench/bench_tree.py [--requests 4000] [--page-size 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.cache.config import CacheConfig
from tierkv.eviction import eviction_order
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool, KVSpec
from tierkv.radix import RadixKey


def conversations(num_requests: int, seed: int = 0, num_prompts: int = 8, prompt_tokens: int = 512,
                  user_tokens: int = 48, reply_tokens: int = 96, live: int = 64):
    """Yield (prompt_tokens, reply_tokens) per request, interleaving ``live`` conversations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(32000) for _ in range(prompt_tokens)] for _ in range(num_prompts)]

    def new_history():
        return list(rng.choice(prompts))

    histories = [new_history() for _ in range(live)]
    for _ in range(num_requests):
        i = rng.randrange(live)
        if len(histories[i]) > 3000 or rng.random() < 0.1:
            histories[i] = new_history()
        prompt = histories[i] + [rng.randrange(32000) for _ in range(rng.randint(1, user_tokens))]
        reply = [rng.randrange(32000) for _ in range(rng.randint(1, reply_tokens))]
        histories[i] = prompt + reply
        yield prompt, reply


class Timer:
    def __init__(self) -> None:
        self.total_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total_s[name] += time.thread_time() - start
                self.calls[name] += 1
        return timed


def run(num_requests: int, page_size: int, pool_tokens: int, policy: str,
        per_call_heap: bool = False) -> tuple[Timer, float, HiRadixCache]:
    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float16)  # tree cost, not KV bytes
    cache = HiRadixCache(DeviceKVPool(spec, pool_tokens, page_size, "cpu"),
                         CacheConfig(page_size=page_size, eviction_policy=policy, enable_host=False))
    if per_call_heap:  # the baseline: rank the whole leaf frontier on every evict()
        heap = cache.eviction._device_heap
        heap.victims = lambda: eviction_order(cache.tree.device_leaves(), heap.order, heap._next_leaf)
    timer = Timer()
    cache.eviction.evict = timer.wrap("evict", cache.eviction.evict)  # alloc_device evicts through it too
    match, insert = timer.wrap("match_prefix", cache.match_prefix), timer.wrap("insert", cache.insert)
    alloc = timer.wrap("alloc_device (incl. evict)", cache.alloc_device)
    start = time.thread_time()
    for prompt, reply in conversations(num_requests):
        m = match(RadixKey(prompt))
        cache.inc_lock_ref(m.last_device_node)
        tokens = prompt + reply
        need = len(tokens) - len(m.device_indices)
        need += (-need) % page_size
        slots = alloc(need)
        if slots is None:
            cache.dec_lock_ref(m.last_device_node)
            continue
        all_slots = torch.cat([m.device_indices, slots])
        owned = insert(RadixKey(tokens), all_slots)
        if owned < len(all_slots):
            cache.device_pool.free(all_slots[owned:])
        cache.dec_lock_ref(m.last_device_node)
    return timer, time.thread_time() - start, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--pool-tokens", type=int, default=65536)
    parser.add_argument("--policy", default="lru")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name, per_call_heap in (("persistent heap", False), ("per-call heap", True)):
        results[name] = run(args.requests, args.page_size, args.pool_tokens, args.policy, per_call_heap)
    timer, wall_s, cache = results["persistent heap"]
    nodes = sum(1 for _ in cache.tree.nodes())
    print(f"{args.requests} requests, page_size {args.page_size}, L1 {args.pool_tokens} tokens, policy "
          f"{args.policy}; {nodes} nodes, {len(cache.tree.device_leaves())} leaves at the end, "
          f"{cache.stats.device_hit_tokens:,} hit tokens")
    print("baseline: the same run ranking the whole leaf frontier in a fresh heap on every evict()")
    print(f"{'operation':<28}{'calls':>7}{'us/call':>10}{'ops/s':>10}{'share':>7}"
          f"{'baseline us':>13}{'speedup':>9}")
    base_timer, base_wall_s, _ = results["per-call heap"]
    rows = [(name, timer.calls[name], timer.total_s[name], base_timer.total_s[name])
            for name in ("match_prefix", "insert", "alloc_device (incl. evict)", "evict")]
    rows.append(("whole request", args.requests, wall_s, base_wall_s))
    for name, calls, total, base in rows:
        per, base_per = total / calls * 1e6, base / calls * 1e6
        print(f"{name:<28}{calls:>7}{per:>10.1f}{calls / total:>10,.0f}{total / wall_s:>7.0%}"
              f"{base_per:>13.1f}{base_per / per:>8.2f}x")


if __name__ == "__main__":
    main()
