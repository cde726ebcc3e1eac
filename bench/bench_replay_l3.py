"""`tierkv replay --l3 file:DIR` against the same replay without L3 (and, optionally, with the in-memory L3).

Each run is the command a user types (`python -m tierkv replay TRACE --limit N --no-baselines --serial
[--l3 SPEC]`), in its own subprocess, timed by its CPU (user + system, from the kernel's accounting of
the child: imports, trace parsing, the L3's worker threads and the kernel's file work included). The
kinds run interleaved (no L3, file L3, ..., the order rotating per repeat) so that load from other
processes falls on all alike; each file run gets a fresh, empty directory, removed afterwards (not
timed). The ratio is a kind's CPU over the no-L3 run's in the same repeat; min and median over repeats.

`--defer-cleanup` removes those directories after the last repeat instead. Why: ext4 without a journal (as
here) checks each free inode it considers for a recent deletion (``recently_deleted``, reading the inode's
block: ``find_get_block_common`` in ``perf``), so files created beside thousands just removed cost kernel
time in proportion to what was removed, not to what is written: 2,000 files of 200 KB took 0.17-0.38 s of
system time in a fresh directory here, 1.54 s forty seconds after 10,566 empty files beside it were
removed, and a file run after `file-before`'s 10,566 packs took 2.7-2.9 s of system time, 0.9 s after the
no-L3 run.

By default the replay runs with `--no-baselines --serial`: the cache alone, so the ratio is the L3's
cost against the cache's own; `--with-baselines` times the command as a user types it (the L1-only
replay and MIN beside it, the same work in every kind). `--before DIR` adds the file L3 of another
checkout (DIR, with its native modules built) to the same interleaving, as kind `file-before`: a
before/after pair measured under the same load.

Run:  python bench/bench_replay_l3.py [--limit 500] [--repeats 3] [--memory] [--before /path/to/checkout]
      [--with-baselines] [--defer-cleanup]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl.gz"


def _children_cpu_s() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def run_replay(trace: Path, limit: int, l3: str, page_size: int, repo: Path = ROOT,
               baselines: bool = False) -> tuple[float, float]:
    """One replay of checkout ``repo`` in a subprocess; its (user, system) CPU seconds."""
    command = [sys.executable, "-m", "tierkv", "replay", str(trace), "--limit", str(limit),
               "--page-size", str(page_size), "--l3", l3] + ([] if baselines else ["--no-baselines", "--serial"])
    user_before, sys_before = _children_cpu_s()
    subprocess.run(command, cwd=repo, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(repo)})
    user_after, sys_after = _children_cpu_s()
    return user_after - user_before, sys_after - sys_before


def run_kind(kind: str, args: argparse.Namespace, leftovers: list[str]) -> tuple[float, float]:
    """One timed run of ``kind``; a file kind's directory is removed now, or added to ``leftovers``
    (--defer-cleanup)."""
    if not kind.startswith("file"):
        return run_replay(args.trace, args.limit, kind, args.page_size, baselines=args.with_baselines)
    directory = tempfile.mkdtemp(prefix="tierkv-bench-l3-")
    repo = args.before if kind == "file-before" else ROOT
    try:
        return run_replay(args.trace, args.limit, f"file:{directory}", args.page_size, repo, args.with_baselines)
    finally:
        if args.defer_cleanup:
            leftovers.append(directory)
        else:
            shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (the replay's default: 16)")
    parser.add_argument("--memory", action="store_true", help="also time the in-memory L3 (--l3 memory)")
    parser.add_argument("--with-baselines", action="store_true",
                        help="the command as a user types it: with the baselines (no-cache, L1-only, MIN) beside")
    parser.add_argument("--before", type=Path, help="another checkout whose file L3 runs too (file-before)")
    parser.add_argument("--defer-cleanup", action="store_true",
                        help="remove the file runs' directories after the last repeat, not after each run "
                             "(see the module docstring)")
    args = parser.parse_args()
    args.trace = args.trace.resolve()
    kinds = ["none", "file"] + (["memory"] if args.memory else []) + (["file-before"] if args.before else [])
    cpu: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    leftovers: list[str] = []
    try:
        run_repeats(args, kinds, cpu, leftovers)
    finally:
        for directory in leftovers:
            shutil.rmtree(directory, ignore_errors=True)
    report(args, kinds, cpu)


def run_repeats(args: argparse.Namespace, kinds: list[str], cpu: dict[str, list[tuple[float, float]]],
                leftovers: list[str]) -> None:
    for repeat in range(args.repeats):
        order = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]
        for kind in order:
            cpu[kind].append(run_kind(kind, args, leftovers))
            user_s, sys_s = cpu[kind][-1]
            print(f"repeat {repeat + 1}: {kind:11s} {user_s:6.2f} user + {sys_s:6.2f} sys s", file=sys.stderr)


def report(args: argparse.Namespace, kinds: list[str], cpu: dict[str, list[tuple[float, float]]]) -> None:
    base = [u + s for u, s in cpu["none"]]
    print(f"replay of {args.limit} requests, page {args.page_size}, {args.repeats} interleaved repeats "
          "(CPU s: user + sys; ratio: over the no-L3 run of the same repeat)")
    print(f"{'L3':11s} {'user min':>9s} {'sys min':>8s} {'CPU min':>8s} {'CPU median':>11s} "
          f"{'ratio min':>10s} {'ratio median':>13s}")
    for kind in kinds:
        total = [u + s for u, s in cpu[kind]]
        ratios = [t / b for t, b in zip(total, base)]
        print(f"{kind:11s} {min(u for u, _ in cpu[kind]):9.2f} {min(s for _, s in cpu[kind]):8.2f} "
              f"{min(total):8.2f} {statistics.median(total):11.2f} {min(ratios):9.2f}x "
              f"{statistics.median(ratios):12.2f}x")


if __name__ == "__main__":
    main()
