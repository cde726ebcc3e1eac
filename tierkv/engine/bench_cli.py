"""``tierkv bench engine``'s command line: one model's table (:mod:`tierkv.engine.bench`), or with
``--models`` the crossover over several (:mod:`tierkv.engine.bench_crossover`). Apart from both, which
it imports, so that the crossover can build on the bench without an import circle."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch
from rich.console import Console
from rich.progress import Progress

from tierkv.cache.config import TIER_MODES
from tierkv.engine import bench
from tierkv.engine.bench import L2_FRACTION, ChatWorkload, format_table, run_all
from tierkv.engine.bench_crossover import main_crossover
from tierkv.engine.engine import CACHE_MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierkv bench engine", description=bench.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="tiny-llama",
                        help="preset, config.json or checkpoint dir (small-llama: prefill-dominated on a CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a reduced workload (under 30 s on a CPU)")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--user-tokens", type=int, help="new tokens a user adds each turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, help="runs per mode, best kept (default: 1 with --quick, else 3)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--l2-fraction", type=float, default=L2_FRACTION,
                        help="L2 of the rows that have one, as a fraction of the working set")
    parser.add_argument("--models", help="comma-separated models: print the crossover table over them "
                                         "(no cache vs L1+L2 vs L1+L2+L3, ratios per run) instead")
    parser.add_argument("--tier-mode", choices=TIER_MODES, default="inclusive",
                        help="L1+L2 tiers in the rows with an L2 (exclusive: L2 holds what L1 dropped)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 avoids oversubscription on a shared CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workload = ChatWorkload(num_conversations=8, num_turns=3, system_tokens=128, user_tokens=96,
                                output_tokens=8) \
        if args.quick else ChatWorkload()
    overrides = {"num_conversations": args.conversations, "num_turns": args.turns,
                 "system_tokens": args.system_tokens, "user_tokens": args.user_tokens, "seed": args.seed}
    workload = ChatWorkload(**(asdict(workload) | {k: v for k, v in overrides.items() if v is not None}))
    repeats = args.repeats or (1 if args.quick else 3)
    if args.models:
        return main_crossover(args.models.split(","), workload, args.device, repeats, args.l2_fraction, args.json,
                              args.tier_mode)
    print(f"engine bench: model {args.model} on {args.device}; {workload.num_conversations} conversations x "
          f"{workload.num_turns} turns, {workload.num_system_prompts} shared system prompts of "
          f"{workload.system_tokens} tokens, {workload.user_tokens} user + {workload.output_tokens} output "
          f"tokens per turn; {args.tier_mode} tiers; best of {repeats} interleaved runs per mode", flush=True)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("engine bench", total=repeats * len(CACHE_MODES))
        results = run_all(args.model, workload, args.device, repeats=repeats, l2_fraction=args.l2_fraction,
                          tier_mode=args.tier_mode,
                          on_run=lambda mode: progress.update(task, advance=1, description=f"ran {mode}"))
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(workload), "results": [
                {"mode": r.mode, "error": r.error, "ttft_p50_s": r.ttft_quantile(0.5),
                 "ttft_p99_s": r.ttft_quantile(0.99), "throughput_tokens_per_s": r.throughput,
                 "hit_tokens": r.hit_tokens, "prompt_tokens": r.prompt_tokens} for r in results]}, f, indent=2)
    return 0
