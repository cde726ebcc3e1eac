"""TP agreement cost: one batched collective per step vs one collective per field (the seed's habit).

Spawns ``--world-size`` gloo ranks on 127.0.0.1. Each step agrees on ``F`` progress fields (half MIN,
half MAX): as one int64 tensor through :meth:`TPGroup.agree`, and, as the baseline run side by side in
the same processes, as ``F`` single-field all-reduces. Also times the tree digest used by the TP test.

    python bench/bench_tp.py [--world-size 2] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.radix import RadixKey, RadixTree
from tierkv.tp import TPGroup, tree_digest

FIELD_COUNTS = (2, 8, 32)


def _per_field(tp: TPGroup, mins: list[int], maxes: list[int]) -> None:
    for v in mins:
        tp.all_reduce_min([v])
    for v in maxes:
        tp.all_reduce_max([v])


def _median_ms(fn, steps: int) -> float:
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _digest_ms(num_nodes: int) -> float:
    tree, rng = RadixTree(page_size=1), random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(256)] for _ in range(8)]
    for i in range(num_nodes):
        tokens = rng.choice(prompts)[: rng.randint(16, 256)] + [rng.randrange(32000) for _ in range(32)]
        tree.insert(RadixKey(tokens), list(range(len(tokens))))
    return _median_ms(lambda: tree_digest(tree), 20)


def _rank(rank: int, world_size: int, port: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        tp = TPGroup.from_default_group()
        rows = []
        for fields in FIELD_COUNTS:
            mins, maxes = list(range(fields // 2)), list(range(fields - fields // 2))
            for _ in range(20):  # warm up the connections
                tp.agree(mins, maxes)
            batched, separate = [], []
            for _ in range(5):  # interleave so both see the same machine load
                batched.append(_median_ms(lambda: tp.agree(mins, maxes), steps // 5))
                separate.append(_median_ms(lambda: _per_field(tp, mins, maxes), steps // 5))
            rows.append((fields, statistics.median(batched), statistics.median(separate)))
        if rank == 0:
            print(f"world_size={world_size}, gloo on CPU, median ms per scheduler step")
            print(f"{'fields':>6} {'one collective':>15} {'one per field':>14} {'ratio':>6}")
            for fields, one, each in rows:
                print(f"{fields:>6} {one:>15.3f} {each:>14.3f} {each / one:>6.1f}x")
            for num_nodes in (100, 1000):
                print(f"tree_digest of a tree from {num_nodes} inserts: {_digest_ms(num_nodes):.2f} ms")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args.world_size, port, args.steps), nprocs=args.world_size,
                       start_method="spawn")


if __name__ == "__main__":
    main()
