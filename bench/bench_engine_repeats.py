"""The engine table with a spread: ``tierkv bench engine``'s multi-turn chat replay (same workload, same
engine configs, same replay code) per model preset, every cache mode, repeats interleaved; each repeat's
TTFT p50/p99 and throughput as ratios to the no-cache run of that repeat, min/median over repeats.

One run per mode is the bench's own ``run_mode``; this script only interleaves more of them than its
``--repeats`` (which keeps the best run) and reports the spread. ``--budget-s`` stops starting repeats
once spent (at least ``--min-repeats``), so a GPU check fits its time.

    python bench/bench_engine_repeats.py --device cuda --models tiny-llama,medium-llama,large-llama
    python bench/bench_engine_repeats.py --tiny          # CPU: seconds, checks the script runs

``--workload quick --conversations 16 --l2-fraction 0.1`` makes L2 too small for the working set (L1 + L2
hold about 60 % of it), where what the L1+L2+L3 row gains over L1+L2 is what L3 supplies:
``bench/gpu_check.sh`` runs it on the largest preset to show L3 read when it pays (its "L3 hits" column).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.engine.bench import L2_FRACTION, ChatWorkload, ModeResult, run_mode, warm_up  # noqa: E402
from tierkv.engine.engine import CACHE_MODES, MODE_LABELS  # noqa: E402
from tierkv.engine.loader import build_model  # noqa: E402

QUICK = ChatWorkload(num_conversations=8, num_turns=3, system_tokens=128, user_tokens=96, output_tokens=8)
TINY = ChatWorkload(num_conversations=2, num_turns=2, system_tokens=32, user_tokens=16, output_tokens=4)


def run_model(model_name: str, workload: ChatWorkload, device: str, repeats: int, min_repeats: int,
              budget_s: float, l2_fraction: float = L2_FRACTION) -> list[dict[str, ModeResult]]:
    """Per repeat, every mode once (rotated order); stops after ``repeats`` or past ``budget_s``."""
    model = build_model(model_name, device)
    warm_up(model, device)
    if device.startswith("cuda"):  # one discarded round: kernel compiles (Triton copies) and allocator growth
        for mode in CACHE_MODES:
            run_mode(model, workload, mode, device, 512, l2_fraction)
    started_s, runs = time.perf_counter(), []
    for r in range(repeats):
        if r >= min_repeats and time.perf_counter() - started_s > budget_s:
            break
        modes = CACHE_MODES[r % len(CACHE_MODES):] + CACHE_MODES[:r % len(CACHE_MODES)]
        runs.append({mode: run_mode(model, workload, mode, device, 512, l2_fraction) for mode in modes})
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return runs


def summarise(model_name: str, runs: list[dict[str, ModeResult]]) -> list[dict]:
    rows = []
    for mode in CACHE_MODES:
        errors = [run[mode].error for run in runs if run[mode].error]
        if errors or any(run["none"].error for run in runs):
            rows.append({"model": model_name, "mode": mode, "error": (errors or ["no-cache run failed"])[0]})
            continue
        ratios = {"ttft_p50": [], "ttft_p99": [], "throughput": []}
        for run in runs:
            base, got = run["none"], run[mode]
            ratios["ttft_p50"].append(base.ttft_quantile(0.5) / got.ttft_quantile(0.5))
            ratios["ttft_p99"].append(base.ttft_quantile(0.99) / got.ttft_quantile(0.99))
            ratios["throughput"].append(got.throughput / base.throughput)
        rows.append({"model": model_name, "mode": mode, "repeats": len(runs), "error": None,
                     "ttft_p50_ms": statistics.median(run[mode].ttft_quantile(0.5) for run in runs) * 1e3,
                     "tokens_per_s": statistics.median(run[mode].throughput for run in runs),
                     "l3_hit_tokens": statistics.median(run[mode].hit_tokens.get("L3", 0) for run in runs),
                     "same_outputs": all(run[mode].outputs == run["none"].outputs for run in runs),
                     **{f"{k}_min": min(v) for k, v in ratios.items()},
                     **{f"{k}_median": statistics.median(v) for k, v in ratios.items()}})
    return rows


HEADER = (f"{'model':<14}{'mode':<10}{'n':>3}{'TTFT p50 ms':>13}{'tok/s':>9}{'p50 x min/med':>16}"
          f"{'p99 x min/med':>16}{'tok/s x min/med':>18}{'L3 hits':>9}  same")


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        label = MODE_LABELS[r["mode"]]
        if r["error"]:
            lines.append(f"{r['model']:<14}{label:<10} error: {r['error'][:70]}")
            continue
        cells = "".join(f"{r[k + '_min']:>9.2f}/{r[k + '_median']:<6.2f}" for k in ("ttft_p50", "ttft_p99"))
        lines.append(f"{r['model']:<14}{label:<10}{r['repeats']:>3}{r['ttft_p50_ms']:>13.1f}{r['tokens_per_s']:>9.0f}"
                     f"{cells}{r['throughput_min']:>11.2f}/{r['throughput_median']:<6.2f}"
                     f"{r['l3_hit_tokens']:>9.0f}  {'yes' if r['same_outputs'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/bench_engine_repeats.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="tiny-llama,medium-llama,large-llama")
    parser.add_argument("--workload", choices=["quick", "full"], default="full",
                        help="quick: tierkv bench engine --quick's; full: its default")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=60.0, help="per model: no new repeat after this")
    parser.add_argument("--conversations", type=int, help="concurrent conversations (default: the workload's)")
    parser.add_argument("--l2-fraction", type=float, default=L2_FRACTION,
                        help="L2 of the rows that have one, as a fraction of the working set (at least 1.5x L1)")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny-llama, a tiny workload, 2 repeats")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    workload = QUICK if args.workload == "quick" else ChatWorkload()
    if args.tiny:
        args.device, args.models, workload = "cpu", "tiny-llama", TINY
        args.repeats = args.min_repeats = 2
        torch.set_num_threads(1)
    if args.conversations:
        workload = dataclasses.replace(workload, num_conversations=args.conversations)
    print(f"engine: {workload.num_conversations} conversations x {workload.num_turns} turns, system prompt "
          f"{workload.system_tokens}, {workload.user_tokens} user + {workload.output_tokens} output tokens a turn, "
          f"on {args.device}; L2 {args.l2_fraction} of the working set; ratios to no cache in the same repeat "
          "(above 1: faster), min/median")
    print(f"{HEADER}\n{'-' * len(HEADER)}", flush=True)
    rows = []
    for model_name in args.models.split(","):
        runs = run_model(model_name, workload, args.device, args.repeats, args.min_repeats, args.budget_s,
                         args.l2_fraction)
        rows += summarise(model_name, runs)
        print(format_rows(rows[-len(CACHE_MODES):]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
