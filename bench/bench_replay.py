"""`tierkv replay`'s CPU time against a minimal page-level LRU (bench/page_lru_sim.py) on the same trace.

Each run is its own subprocess, so that each has its own peak RSS; runs are interleaved (baseline, tiered,
tiered with --verify, then again, the order rotating per repeat) so that load from other processes falls on
all of them alike. The ratio is the tiered replay's CPU time over the baseline's in the same repeat; min
and median over repeats are printed. Timed: the replay alone (trace parsing and imports are not).
The tiered replay runs with `tierkv replay`'s defaults (L1 500k + L2 4M tokens, page 16, gdsf,
write_through, no L3); the baseline holds the same total (L1 + L2) in pages.

Run:  python bench/bench_replay.py [--limit 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl.gz"
KINDS = ("lru", "tiered", "tiered --verify")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(args: argparse.Namespace) -> None:
    """Run one replay of ``args.worker`` kind and print one JSON line of its figures."""
    from tierkv.replay.report import parse_size
    from tierkv.replay.trace import load_trace

    requests = load_trace(args.trace, limit=args.limit).requests
    total_tokens = parse_size(args.l1_tokens) + parse_size(args.l2_tokens)
    if args.worker == "lru":
        from page_lru_sim import simulate  # type: ignore[import-not-found]

        run = lambda: simulate(requests, total_tokens, args.page_size)  # noqa: E731
    else:
        import torch

        from tierkv.replay.replay import ReplayConfig, replay

        torch.set_num_threads(1)  # as `tierkv replay` does
        config = ReplayConfig(parse_size(args.l1_tokens), parse_size(args.l2_tokens), page_size=args.page_size,
                              eviction_policy=args.policy, verify=args.worker.endswith("--verify"))
        run = lambda: replay(requests, config)  # noqa: E731
    rss_before = _peak_rss_mib()
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    hit_ratio = result[0] / result[1] if isinstance(result, tuple) else result.hit_ratio
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "hit_ratio": hit_ratio, "rss_before_mib": rss_before,
                      "peak_rss_mib": _peak_rss_mib()}))


def run_one(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--trace", str(args.trace), "--page-size", str(args.page_size),
           "--l1-tokens", args.l1_tokens, "--l2-tokens", args.l2_tokens, "--policy", args.policy]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--l1-tokens", default="500k")
    parser.add_argument("--l2-tokens", default="4M")
    parser.add_argument("--policy", default="gdsf", help="the tiered replay's eviction policy")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in range(args.repeats):
        for i in range(len(KINDS)):
            kind = KINDS[(i + r) % len(KINDS)]
            runs[kind].append(run_one(kind, args))
    base = runs["lru"]
    print(f"trace {Path(args.trace).name}, {args.limit or 'all'} requests, page {args.page_size}, "
          f"L1 {args.l1_tokens} + L2 {args.l2_tokens} tokens; {args.repeats} interleaved repeats")
    print(f"{'run':<18} {'hit ratio':>9} {'CPU s min':>9} {'CPU s med':>9} {'ratio min':>9} {'ratio med':>9} "
          f"{'RSS MiB before':>14} {'peak RSS MiB':>12}")
    for kind in KINDS:
        cpu = [x["cpu_s"] for x in runs[kind]]
        ratios = [x["cpu_s"] / b["cpu_s"] for x, b in zip(runs[kind], base)]
        print(f"{kind:<18} {100 * runs[kind][0]['hit_ratio']:>8.2f}% {min(cpu):>9.2f} {statistics.median(cpu):>9.2f} "
              f"{min(ratios):>9.2f} {statistics.median(ratios):>9.2f} "
              f"{max(x['rss_before_mib'] for x in runs[kind]):>14.0f} {max(x['peak_rss_mib'] for x in runs[kind]):>12.0f}")


if __name__ == "__main__":
    main()
