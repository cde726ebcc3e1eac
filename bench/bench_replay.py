"""`tierkv replay` as a user times it (`/usr/bin/time`: whole process, imports, trace parsing and MIN
included) against a minimal page-level LRU (bench/page_lru_sim.py, torch-free) on the same trace.

Kinds (each run is its own process under `/usr/bin/time`, so CPU is user + sys of the process and of
the children it waited for, and peak RSS is the largest of them):
- ``lru``: ``python bench/page_lru_sim.py TRACE --total-tokens L1+L2`` (the baseline);
- ``replay``: ``python -m tierkv replay TRACE --no-baselines --serial`` (the tiered replay and MIN);
- ``replay+l1only``: ``python -m tierkv replay TRACE`` (the default: also the L1-only replay, beside it in
  a second process).
Runs are interleaved (the order rotating per repeat) so that load from other processes falls on all kinds
alike; each ratio is a kind's CPU over the baseline's in the same repeat, min and median over repeats.

``--scales 1,2,4`` also replays the trace repeated 2 and 4 times, each copy's block ids shifted past the
last (every copy is new content, so the working set grows with the trace): peak RSS must stay flat.

Run:  python bench/bench_replay.py [--repeats 3] [--scales 1] [--kinds lru,replay,replay+l1only]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl.gz"
KINDS = ("lru", "replay", "replay+l1only")
TIME_FORMAT = "%U %S %M"  # user s, system s, peak RSS KiB


def scaled_trace(trace: Path, scale: int, folder: Path) -> Path:
    """``trace`` repeated ``scale`` times, each copy's block ids past the previous copy's, its timestamps
    after the previous copy's end."""
    if scale == 1:
        return trace
    with gzip.open(trace, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    id_shift = 1 + max((h for r in rows for h in r["hash_ids"]), default=0)
    time_shift = 1 + max((r["timestamp"] for r in rows), default=0)
    path = folder / f"{trace.name.split('.')[0]}_x{scale}.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for copy in range(scale):
            for r in rows:
                f.write(json.dumps({**r, "timestamp": r["timestamp"] + copy * time_shift,
                                    "hash_ids": [h + copy * id_shift for h in r["hash_ids"]]}) + "\n")
    return path


def command(kind: str, trace: Path, args: argparse.Namespace, json_path: Path) -> list[str]:
    sizes = ["--page-size", str(args.page_size)]
    if kind == "lru":
        return [sys.executable, str(ROOT / "bench" / "page_lru_sim.py"), str(trace), "--total-tokens",
                str(args.total_tokens), *sizes]
    cmd = [sys.executable, "-m", "tierkv", "replay", str(trace), "--l1-tokens", args.l1_tokens, "--l2-tokens",
           args.l2_tokens, *(["--policy", args.policy] if args.policy else []), "--json", str(json_path), *sizes]
    return cmd + (["--no-baselines", "--serial"] if kind == "replay" else [])


def run_timed(cmd: list[str], folder: Path) -> dict:
    """CPU s (user + sys) and peak RSS MiB of ``cmd`` under /usr/bin/time; its stdout."""
    times = folder / "time.txt"
    out = subprocess.run(["/usr/bin/time", "-o", str(times), "-f", TIME_FORMAT, *cmd], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    user_s, sys_s, peak_kib = times.read_text().split()[-3:]
    return {"cpu_s": float(user_s) + float(sys_s), "peak_rss_mib": int(peak_kib) / 1024, "stdout": out}


def hit_ratio(kind: str, stdout: str, json_path: Path) -> float:
    if kind == "lru":
        return float(re.search(r"hit ([\d.]+) %", stdout).group(1)) / 100
    return json.loads(json_path.read_text())["hit_ratio"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scales", default="1", help="comma-separated trace multiples, e.g. 1,2,4")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--l1-tokens", default="500k")
    parser.add_argument("--l2-tokens", default="4M")
    parser.add_argument("--policy", default=None,
                        help="the tiered replay's eviction policy (default: the replay's own, as a user runs it)")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS) or "lru" not in kinds:
        parser.error(f"--kinds {args.kinds!r}: lru (the baseline) and any of {list(KINDS)}")
    sys.path.insert(0, str(ROOT))
    from tierkv.replay.report import parse_size

    args.total_tokens = parse_size(args.l1_tokens) + parse_size(args.l2_tokens)
    scales = [int(s) for s in args.scales.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        traces = {s: scaled_trace(Path(args.trace), s, folder) for s in scales}
        runs: dict[tuple[str, int], list[dict]] = {(k, s): [] for k in kinds for s in scales}
        for r in range(args.repeats):
            for s in scales:
                for i in range(len(kinds)):
                    kind = kinds[(i + r) % len(kinds)]
                    json_path = folder / "report.json"
                    run = run_timed(command(kind, traces[s], args, json_path), folder)
                    run["hit_ratio"] = hit_ratio(kind, run.pop("stdout"), json_path)
                    runs[kind, s].append(run)
    print(f"trace {Path(args.trace).name} x {args.scales}, page {args.page_size}, L1 {args.l1_tokens} + L2 "
          f"{args.l2_tokens} tokens ({args.policy or 'default policy'}); {args.repeats} interleaved repeats, "
          "/usr/bin/time")
    print(f"{'run':<14} {'scale':>5} {'hit ratio':>9} {'CPU s min':>9} {'CPU s med':>9} {'ratio min':>9} "
          f"{'ratio med':>9} {'peak RSS MiB':>12}")
    for s in scales:
        for kind in kinds:
            cpu = [x["cpu_s"] for x in runs[kind, s]]
            ratios = [x["cpu_s"] / b["cpu_s"] for x, b in zip(runs[kind, s], runs["lru", s])]
            print(f"{kind:<14} {s:>5} {100 * runs[kind, s][0]['hit_ratio']:>8.2f}% {min(cpu):>9.2f} "
                  f"{statistics.median(cpu):>9.2f} {min(ratios):>9.2f} {statistics.median(ratios):>9.2f} "
                  f"{max(x['peak_rss_mib'] for x in runs[kind, s]):>12.0f}")


if __name__ == "__main__":
    main()
