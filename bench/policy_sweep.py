"""Eviction policies against Belady's MIN: hit ratio and fraction of MIN per trace, capacity and tiers.

Runs the page-level simulator (tierkv.replay.sim: the real tree and policy objects, slot counts instead
of pools; it matches the full replay exactly on LRU) for every policy at every total capacity, as:
- ``l1``: one tier of the whole capacity (the L1-only radix cache);
- ``inclusive``: L1 = capacity / 9 (at least the longest prompt), L2 the rest, write-through;
- ``exclusive``: the same split, L2 holds what L1 dropped (``CacheConfig(tier_mode="exclusive")``).
MIN is the offline optimum of one tier of the whole capacity (tierkv.replay.optimal).

Run:  /work/venv/bin/python bench/policy_sweep.py TRACE [TRACE...] [--sizes 1M,4.5M,10M]
          [--policies lru,gdsf,...] [--modes l1,inclusive,exclusive] [--json OUT] [--jobs 2] [--swap-loads] [--whole-nodes]
      /work/venv/bin/python bench/policy_sweep.py --render OUT [OUT...]   (one table from saved --json runs:
          a row per trace, capacity and policy; tiered minus L1-only per tier mode; a summary per policy)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tierkv.replay.optimal import belady_min
from tierkv.replay.report import longest_prompt_tokens, parse_sizes
from tierkv.replay.sim import SimConfig, simulate
from tierkv.replay.trace import load_trace
from tierkv.eviction import POLICIES

MODES = ("l1", "inclusive", "exclusive")
_TRACES: dict[str, list] = {}


def sim_config(mode: str, total_tokens: int, policy: str, page_size: int, admission: bool = False,
               min_l1_tokens: int = 0) -> SimConfig:
    """The simulated cache of ``mode`` at ``total_tokens``: when tiered, L1 a ninth of it but at least
    ``min_l1_tokens`` (the longest prompt: an engine cannot compute a prompt its KV pool cannot hold, and
    refuses to start with one that small; see tierkv.replay.report.sweep_config)."""
    if mode == "l1":
        return SimConfig(l1_tokens=total_tokens, page_size=page_size, eviction_policy=policy)
    l1 = total_tokens // 9 // page_size * page_size
    l1 = max(l1, min(-(-min_l1_tokens // page_size) * page_size, total_tokens // 2 // page_size * page_size))
    # exclusive tiers copy on eviction only: no write-through hit counting, as CacheConfig.write_threshold says
    return SimConfig(l1_tokens=l1, l2_tokens=total_tokens - l1, page_size=page_size, eviction_policy=policy,
                     tier_mode=mode, admission=admission, write_threshold=None if mode == "exclusive" else 1)


def _run(job: tuple) -> dict:
    path, mode, total, policy, page_size, admission, swap_loads, whole_nodes = job
    requests = _TRACES.setdefault(path, load_trace(path).requests)
    start = time.process_time()
    config = sim_config(mode, total, policy, page_size, admission, longest_prompt_tokens(requests))
    if swap_loads and mode == "exclusive":  # a what-if the cache does not do (SimConfig.swap_loads)
        config = dataclasses.replace(config, swap_loads=True)
    if whole_nodes:  # HiCache's eviction granularity
        config = dataclasses.replace(config, split_victims=False)
    result = simulate(requests, config)
    return {"trace": path, "mode": mode, "capacity_tokens": total, "policy": policy, "admission": admission,
            "l1_tokens": config.l1_tokens, "hit_ratio": result.hit_ratio, "written_tokens": result.written_tokens,
            "cpu_s": time.process_time() - start}


def sweep(traces: list[str], sizes: list[int], policies: list[str], modes: list[str], page_size: int = 16,
          jobs: int = 2, admission: bool = False, swap_loads: bool = False, whole_nodes: bool = False
          ) -> list[dict]:
    """Every (trace, mode, size, policy) point, each with MIN and its fraction of MIN."""
    optimum = {(t, s): belady_min(load_trace(t).requests, s, page_size).hit_ratio for t in traces for s in sizes}
    work = [(t, m, s, p, page_size, admission, swap_loads, whole_nodes)
            for t in traces for m in modes for s in sizes for p in policies]
    points = []
    with ProcessPoolExecutor(jobs) as pool:
        for p in pool.map(_run, work):
            p["optimal_hit_ratio"] = optimum[(p["trace"], p["capacity_tokens"])]
            p["fraction_of_min"] = p["hit_ratio"] / p["optimal_hit_ratio"] if p["optimal_hit_ratio"] else 0.0
            print(json.dumps(p), file=sys.stderr, flush=True)  # progress, one point a line
            points.append(p)
    return points


def markdown(points: list[dict]) -> str:
    """One table per trace and mode: a row per policy, hit ratio (fraction of MIN) per capacity."""
    lines = []
    for trace in dict.fromkeys(p["trace"] for p in points):
        for mode in dict.fromkeys(p["mode"] for p in points):
            rows = [p for p in points if p["trace"] == trace and p["mode"] == mode]
            sizes = sorted({p["capacity_tokens"] for p in rows})
            lines += [f"\n{Path(trace).name}, {mode}:", "",
                      "| policy | " + " | ".join(f"{s / 1e6:g}M" for s in sizes) + " |",
                      "|---" * (len(sizes) + 1) + "|"]
            mins = {p["capacity_tokens"]: p["optimal_hit_ratio"] for p in rows}
            lines.append("| MIN | " + " | ".join(f"{100 * mins[s]:.1f} %" for s in sizes) + " |")
            for policy in dict.fromkeys(p["policy"] for p in rows):
                cells = {p["capacity_tokens"]: p for p in rows if p["policy"] == policy}
                lines.append(f"| {policy} | " + " | ".join(
                    f"{100 * cells[s]['hit_ratio']:.1f} % ({cells[s]['fraction_of_min']:.2f})" for s in sizes) + " |")
    return "\n".join(lines)


def _points(difference: float) -> str:
    """A hit-ratio difference in percentage points; "=" only when exactly equal (-0.00 is a loss)."""
    return "=" if difference == 0 else f"{100 * difference:+.2f}"


def one_table(points: list[dict]) -> str:
    """Every point in one table: a row per (trace, capacity, policy) with L1-only, each tiered mode and its
    difference to L1-only at the same total, and MIN; then per policy and mode the mean fraction of MIN, the
    worst difference to L1-only and the points where the policy is the best of the table."""
    cell = {(p["trace"], p["capacity_tokens"], p["policy"], p["mode"]): p for p in points}
    traces = list(dict.fromkeys(p["trace"] for p in points))
    policies = list(dict.fromkeys(p["policy"] for p in points))
    tiered = [m for m in ("exclusive", "inclusive") if any(p["mode"] == m for p in points)]
    head = ["trace", "total", "MIN", "policy", "L1-only"] + [f"{m}, vs L1" for m in tiered]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    sites = [(t, s) for t in traces for s in sorted({p["capacity_tokens"] for p in points if p["trace"] == t})]
    for trace, size in sites:
        for policy in policies:
            one = cell.get((trace, size, policy, "l1"))
            if one is None:
                continue
            row = [Path(trace).name.split(".")[0], f"{size / 1e6:g}M", f"{100 * one['optimal_hit_ratio']:.1f}",
                   policy, f"{100 * one['hit_ratio']:.2f}"]
            for mode in tiered:
                p = cell.get((trace, size, policy, mode))
                row.append("-" if p is None else
                           f"{100 * p['hit_ratio']:.2f} ({_points(p['hit_ratio'] - one['hit_ratio'])})")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| policy, mode | mean fraction of MIN | worst tiered - L1-only (points) | best of the table at |",
              "|---|---|---|---|"]
    for mode in ["l1"] + tiered:
        best = {site: max(cell[site + (q, mode)]["hit_ratio"] for q in policies if site + (q, mode) in cell)
                for site in sites}
        for policy in policies:
            mine = [cell[site + (policy, mode)] for site in sites if site + (policy, mode) in cell]
            if not mine:
                continue
            mean = sum(p["fraction_of_min"] for p in mine) / len(mine)
            gaps = [p["hit_ratio"] - cell[(p["trace"], p["capacity_tokens"], policy, "l1")]["hit_ratio"]
                    for p in mine]
            wins = sum(p["hit_ratio"] >= best[(p["trace"], p["capacity_tokens"])] for p in mine)
            worst = "-" if mode == "l1" else _points(min(gaps))
            lines.append(f"| {policy}, {mode} | {mean:.3f} | {worst} | {wins} of {len(mine)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--render", nargs="+", metavar="JSON", help="print one table from saved --json runs, run nothing")
    ap.add_argument("--sizes", default="1M,4.5M,10M")
    ap.add_argument("--policies", default=",".join(p for p in POLICIES if p not in ("priority", "mru")))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--admission", action="store_true", help="tiers ask the policy before copying to L2")
    ap.add_argument("--swap-loads", action="store_true",
                    help="what-if: an exclusive load's L2 slots take the pages L1 demotes for it at once "
                         "(a swap; the cache loads in chunks)")
    ap.add_argument("--whole-nodes", action="store_true", help="evict whole nodes, as HiCache (split_victims=False)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    if args.render:
        print(one_table([p for path in args.render for p in json.loads(Path(path).read_text())]))
        return
    if not args.traces:
        ap.error("give TRACE files to sweep, or --render JSON files")
    points = sweep(args.traces, parse_sizes(args.sizes), args.policies.split(","), args.modes.split(","),
                   args.page_size, args.jobs, args.admission, args.swap_loads,
                   args.whole_nodes)
    print(markdown(points))
    if args.json:
        Path(args.json).write_text(json.dumps(points, indent=1) + "\n")


if __name__ == "__main__":
    main()
