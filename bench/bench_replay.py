"""Replay throughput (requests/s) on conversation_trace.jsonl, with the L1-only radix cache as baseline.

Each configuration replays the same requests through a fresh real cache in this process, one after the
other; the ratio column is the tiered replay's cost relative to the plain L1 cache of the same total size.

Run:  /work/venv/bin/python bench/bench_replay.py [--limit 3000] [--page-size 16] [--l3 file:/tmp/x]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from tierkv.replay.optimal import belady_min
from tierkv.replay.replay import ReplayConfig, replay
from tierkv.replay.report import parse_size
from tierkv.replay.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = next((p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared")
              if (p / "data" / "traces").is_dir()), ROOT.parent / "shared") / "data/traces/conversation_trace.jsonl"


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--l1-tokens", default="500k")
    parser.add_argument("--l2-tokens", default="4M")
    parser.add_argument("--l3", default="none", help="also replay with this L3 (e.g. file:/tmp/dir, memory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trace = load_trace(args.trace, limit=args.limit)
    n = len(trace.requests)
    tiered = ReplayConfig(parse_size(args.l1_tokens), parse_size(args.l2_tokens), page_size=args.page_size)
    configs = [("L1-only (baseline)", replace(tiered, l1_tokens=tiered.total_tokens, l2_tokens=None)),
               ("L1+L2", tiered)]
    if args.l3 != "none":
        l3 = args.l3
        if l3 == "file:":
            l3 = f"file:{tempfile.mkdtemp(prefix='tierkv-bench-l3-')}"
        configs.append((f"L1+L2+L3 {l3.split(':')[0]}", replace(tiered, l3=l3)))
    rows = []
    for name, config in configs:
        result, wall_s, cpu_s = timed(lambda: replay(trace.requests, config))
        rows.append((name, result.hit_ratio, n / wall_s, cpu_s * 1000 / n))
    _, wall_s, cpu_s = timed(lambda: belady_min(trace.requests, tiered.total_tokens, args.page_size))
    rows.append(("Belady MIN bound", float("nan"), n / wall_s, cpu_s * 1000 / n))
    base = rows[0][2]
    print(f"replay of {n} requests ({trace.prompt_tokens:,} prompt tokens), page {args.page_size}, "
          f"L1 {tiered.l1_tokens:,} + L2 {tiered.l2_tokens:,} tokens")
    print(f"{'configuration':<22} {'hit ratio':>9} {'requests/s':>11} {'CPU ms/req':>11} {'vs baseline':>12}")
    for name, ratio, rps, cpu_ms in rows:
        shown = "" if ratio != ratio else f"{100 * ratio:.2f} %"
        print(f"{name:<22} {shown:>9} {rps:>11,.0f} {cpu_ms:>11.2f} {rps / base:>11.2f}x")


if __name__ == "__main__":
    main()
