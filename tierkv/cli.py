"""Command line: ``tierkv replay`` (trace replay with baselines), ``tierkv serve``, ``tierkv bench engine``.

One argparse tree with a subcommand each. ``serve`` and ``bench`` come from the engine package
(tierkv.engine.cli); a build without it still replays, and says what ``serve`` and ``bench`` need.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console

from tierkv.cli_args import HelpFormatter, token_count
from tierkv.cache.config import TIER_MODES, WRITE_POLICIES, CacheConfig
from tierkv.eviction import POLICIES

DEFAULT_L1_TOKENS = "500k"  # ~61 GiB of Llama-3-8B KV: what one 80 GB GPU keeps for KV
DEFAULT_L2_TOKENS = "4M"  # 8x L1: ~0.5 TiB of host memory
ENGINE_COMMANDS = {"serve": "serve a model over an OpenAI-compatible HTTP API with the tiered cache",
                   "bench": "benchmarks of the engine (`tierkv bench engine`)"}


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    from tierkv.replay.ttft import GPU_PEAK_FLOPS, MODELS

    p = sub.add_parser("replay", help="replay a Mooncake-format trace through L1/L2/L3 with baselines",
                       formatter_class=HelpFormatter,
                       description="Replay a request trace through the real hierarchical cache and report "
                                   "hits per tier, the L1-only and no-cache baselines, the offline optimum "
                                   "(Belady MIN) and a modelled TTFT.")
    p.set_defaults(run=_run_replay)
    p.add_argument("trace", help="JSONL trace, or .jsonl.gz (timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--l1-tokens", type=token_count, default=DEFAULT_L1_TOKENS,
                   help="L1 (device) capacity; 250k, 1M, ...")
    p.add_argument("--l2-tokens", type=token_count, default=DEFAULT_L2_TOKENS, help="L2 (host) capacity; 0 for no L2")
    p.add_argument("--l3", default="none", help="none | file:DIR | redis://HOST:PORT[/DB] | other store spec")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page (the trace's blocks are 512)")
    p.add_argument("--policy", default=CacheConfig.eviction_policy, choices=sorted(POLICIES),
                   help="eviction policy (README: 'Eviction policies and tiers' compares them)")
    p.add_argument("--write-policy", default="write_through", choices=sorted(WRITE_POLICIES),
                   help="when an insert is backed up (to L2 in inclusive tiers, to L3 in exclusive ones): "
                        "write_through (on insert), write_through_selective (on the second hit), write_back "
                        "(on L1 eviction); HiCache's policies")
    p.add_argument("--tier-mode", default=CacheConfig.tier_mode, choices=TIER_MODES,
                   help="exclusive (default): L2 keeps what L1 dropped, L3 gets inserts per the write policy; "
                        "inclusive (HiCache's): L2 copies L1 per the write policy")
    p.add_argument("--load-chunk-tokens", type=int, default=None,
                   help="exclusive tiers: a load back that makes L2 evict goes in chunks of this many tokens "
                        "(0: one; default: L1 / 256, 256 to 8192)")
    p.add_argument("--l2-admission", action="store_true",
                   help="copy a node to L2 only if the policy admits it (e.g. tinylfu: used twice)")
    p.add_argument("--l3-tokens", default=None, help="a bounded L3's capacity, for MIN's bound (default: unbounded)")
    p.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS), help="model for the TTFT model")
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="KV bytes per token for transfer times and bytes moved (default: the model's)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPU_PEAK_FLOPS), help="GPU peak FLOP/s")
    p.add_argument("--mfu", type=float, default=0.5, help="model FLOP utilisation of prefill")
    p.add_argument("--l2-gbps", type=float, default=40.0, help="L2->L1 bandwidth, GB/s")
    p.add_argument("--l2-latency-us", type=float, default=10.0, help="L2->L1 latency per batch, us")
    p.add_argument("--l3-gbps", type=float, default=6.0, help="L3->L2 bandwidth, GB/s")
    p.add_argument("--l3-latency-us", type=float, default=100.0, help="L3->L2 latency per batch, us")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="plot hits and TTFT (or the sweep, with --sweep)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests (default: all)")
    p.add_argument("--sweep", metavar="SIZES", help="also sweep total capacity, e.g. 250k,1M,3M,10M")
    p.add_argument("--sweep-policies", metavar="NAMES", default="",
                   help="compare these policies too in the sweep, e.g. lru,gdsf,s3fifo (or 'all'; default: "
                        "--policy only)")
    p.add_argument("--sweep-engine", default="replay", choices=("replay", "sim"),
                   help="sweep with the full replay or the page-level simulator (same tree and policies)")
    p.add_argument("--include-output", action="store_true", help="insert generated tokens too")
    p.add_argument("--skip-bad", action="store_true", help="skip (and count) bad trace lines")
    p.add_argument("--no-baselines", action="store_true", help="skip the L1-only replay")
    p.add_argument("--verify", action="store_true", help="check every reused prefix's KV (slower)")
    p.add_argument("--serial", action="store_true", help="run the baselines after, not beside, the replay")


def build_parser() -> argparse.ArgumentParser:
    from tierkv import __version__

    parser = argparse.ArgumentParser(prog="tierkv", description="hierarchical prefix KV cache tools",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tierkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _replay_parser(sub)
    _engine_parsers(sub)
    return parser


def _engine_parsers(sub: argparse._SubParsersAction) -> None:
    """``serve`` and ``bench`` from tierkv.engine.cli, or stand-ins that say the engine is missing."""
    try:
        engine_cli = importlib.import_module("tierkv.engine.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("tierkv.engine", "tierkv.engine.cli"):
            raise
        for name, text in ENGINE_COMMANDS.items():
            p = sub.add_parser(name, help=f"{text} (needs tierkv.engine, which this build does not have)")
            p.set_defaults(run=_engine_missing)  # its arguments are left unparsed (main)
        return
    engine_cli.add_commands(sub, ENGINE_COMMANDS)


def _engine_missing(args: argparse.Namespace) -> int:
    print(f"tierkv: `{args.command}` needs the engine (tierkv.engine.cli), which this build does not have",
          file=sys.stderr)
    return 2


def _model_from_args(args: argparse.Namespace):
    from tierkv.replay.ttft import GPU_PEAK_FLOPS, Link, TTFTModel, get_model

    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu!r}")
    return TTFTModel(get_model(args.model), GPU_PEAK_FLOPS[args.gpu] * args.mfu, args.kv_bytes_per_token,
                     Link(args.l2_gbps * 1e9, args.l2_latency_us * 1e-6),
                     Link(args.l3_gbps * 1e9, args.l3_latency_us * 1e-6))


def _sweep_policies(args: argparse.Namespace) -> list[str]:
    names = sorted(POLICIES) if args.sweep_policies == "all" else [
        n.strip() for n in args.sweep_policies.split(",") if n.strip()]
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"--sweep-policies: unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}")
    return names


def replay_main(args: argparse.Namespace) -> int:
    import torch

    from tierkv.replay.replay import ReplayConfig
    from tierkv.replay.report import (build_report, parse_size, parse_sizes, plot_report, plot_sweep,
                                     print_report, run_all, run_sweep, sweep_title, write_json)
    from tierkv.replay.trace import load_trace

    l2 = parse_size(args.l2_tokens)
    config = ReplayConfig(l1_tokens=parse_size(args.l1_tokens), l2_tokens=l2 or None, page_size=args.page_size,
                          eviction_policy=args.policy, write_policy=args.write_policy, l3=args.l3,
                          include_output=args.include_output, verify=args.verify, tier_mode=args.tier_mode,
                          l2_admission=args.l2_admission, load_chunk_tokens=args.load_chunk_tokens,
                          l3_tokens=None if args.l3_tokens is None else parse_size(args.l3_tokens))
    # Everything that would fail after the replay fails now: outputs, the L3, the trace.
    from tierkv.replay import preflight

    preflight.check_limit(args.limit)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            preflight.check_output_path(flag, path)
    if args.l3 != "none":
        preflight.check_l3(args.l3)
    model = _model_from_args(args)
    sizes = parse_sizes(args.sweep) if args.sweep else None
    trace = load_trace(args.trace, limit=args.limit, skip_bad=args.skip_bad)
    preflight.check_requests(args.trace, len(trace.requests), len(trace.bad_lines))
    # The replay's ops are tiny: intra-op threads only add hand-offs, and with the baselines in a second
    # process they oversubscribe the cores (~25% of the wall time on 2 cores).
    torch.set_num_threads(1)
    err = Console(stderr=True)
    for bad in trace.bad_lines[:5]:
        err.print(f"skipped {bad}")
    run = run_all(trace, config, baselines=not args.no_baselines, console=err, parallel=not args.serial)
    report = build_report(run, model, args.trace)
    if sizes:
        report["sweep"] = run_sweep(trace, config, sizes, console=err, policies=_sweep_policies(args),
                                    engine=args.sweep_engine)
    print_report(report)
    if args.json:
        write_json(report, args.json)
    if args.plot:
        (plot_sweep(report["sweep"], args.plot, sweep_title(report)) if sizes else plot_report(report, args.plot))
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    try:
        return replay_main(args)
    except (ValueError, OSError) as exc:
        print(f"tierkv replay: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if unknown and args.run is not _engine_missing:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
