"""Command lines: ``tierkv serve`` and ``tierkv bench engine`` (registered in ``tierkv``'s parser by
tierkv.cli; ``python -m tierkv.engine.cli serve|bench ...`` runs them without it)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from tierkv.cli_args import HelpFormatter, port_number
from tierkv.engine import bench
from tierkv.engine.config import PRESETS
from tierkv.engine.engine import Engine
from tierkv.engine.serve_config import CliError, add_cache_arguments, engine_config_from_args

SERVE_DESCRIPTION = "OpenAI-compatible completions and chat server with the tiered prefix cache."


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}: random weights, text output is noise), a config.json, "
                             "or a checkpoint directory (its own tokenizer when it has one)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: --model)")
    parser.add_argument("--device", default="cpu",
                        help="torch device for the model and L1 (cpu, cuda, cuda:1); checked at start")
    server = parser.add_argument_group("HTTP server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=port_number, default=8000, help="TCP port; 0 picks a free one")
    server.add_argument("--api-key", default=None, help="require this API key (one tenant)")
    server.add_argument("--tenant-keys", default=None, metavar="FILE",
                        help="file of `TENANT KEY` lines: each key's requests get their own cache namespace")
    server.add_argument("--read-timeout-s", type=float, default=30.0, help="time a client has to send a request")
    server.add_argument("--max-connections", type=int, default=1024, help="open connections beyond are refused")
    server.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests queued for admission beyond are answered 429 with Retry-After")
    server.add_argument("--model-id", default=None,
                        help="a name added to the model's L3 namespace (which always digests config and weights)")
    add_cache_arguments(parser)


def serve_parser() -> argparse.ArgumentParser:
    """``tierkv serve``'s parser on its own (``python -m tierkv.engine.cli serve``)."""
    parser = argparse.ArgumentParser(prog="tierkv serve", formatter_class=HelpFormatter,
                                     description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    return parser


def add_commands(sub: argparse._SubParsersAction, helps: dict[str, str]) -> None:
    """Add ``serve`` and ``bench`` (with its own subcommand ``engine``) to ``tierkv``'s subparsers."""
    _add_serve(sub, helps["serve"])
    bench_parser = sub.add_parser("bench", help=helps["bench"], formatter_class=HelpFormatter,
                                  description="Benchmarks of the engine. Replay benchmarks: python "
                                              "bench/bench_replay.py")
    benchmarks = bench_parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _add_engine_bench(benchmarks, "engine", "TTFT and throughput per cache mode on a chat workload "
                                            "(--models: the crossover table over model sizes)")


def _add_serve(sub: argparse._SubParsersAction, help_text: str) -> None:
    serve = sub.add_parser("serve", help=help_text, description=SERVE_DESCRIPTION, formatter_class=HelpFormatter)
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)


def _add_engine_bench(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=bench.DESCRIPTION, formatter_class=HelpFormatter)
    bench.add_arguments(parser)
    parser.set_defaults(run=bench.run)


def read_tenant_keys(path: str) -> dict[str, str]:
    """``TENANT KEY`` lines (blank lines and ``#`` comments ignored) as {key: tenant}."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--tenant-keys {path}: cannot read it: {exc}") from None
    keys: dict[str, str] = {}
    for line_no, line in enumerate(lines, start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise CliError(f"--tenant-keys {path}: line {line_no}: expected `TENANT KEY`")
        tenant, key = fields
        if key in keys:
            raise CliError(f"--tenant-keys {path}: line {line_no}: key of tenant {tenant!r} repeats an earlier key")
        keys[key] = tenant
    if not keys:
        raise CliError(f"--tenant-keys {path}: no keys")
    return keys


def _build_server(args: argparse.Namespace):
    try:
        from tierkv.engine.server import CompletionServer, ServerLimits
    except ModuleNotFoundError as exc:
        raise CliError(f"serving needs {exc.name}: pip install 'tierkv-hicache[serve]'") from None
    from tierkv.engine.tokenizer import load_tokenizer

    config = engine_config_from_args(args)
    keys = read_tenant_keys(args.tenant_keys) if args.tenant_keys else None
    if args.api_key:
        keys = (keys or {}) | {args.api_key: "default"}
    try:
        limits = ServerLimits(read_timeout_s=args.read_timeout_s, max_connections=args.max_connections,
                              max_waiting_requests=args.max_waiting_requests)
    except ValueError as exc:
        raise CliError(f"--read-timeout-s / --max-connections / --max-waiting-requests: {exc}") from None
    tokenizer = load_tokenizer(args.model)
    try:
        engine = Engine(args.model, config)
    except (RuntimeError, MemoryError) as exc:  # torch's allocation failures
        raise CliError(f"--l1-tokens {args.l1_tokens}: cannot allocate the cache pools: "
                       f"{str(exc).splitlines()[0]}") from None
    try:
        return CompletionServer(engine, args.host, args.port, model_name=args.served_model_name or args.model,
                                tokenizer=tokenizer, api_keys=keys, limits=limits)
    except OSError as exc:
        engine.close()
        raise CliError(f"--host {args.host} --port {args.port}: cannot listen: {exc.strerror or exc}") from None


def startup_summary(server, args: argparse.Namespace) -> list[str]:
    """What an operator needs to know at a glance: model, tiers with sizes and policies, L3 and its cost
    model, tenants, limits, address."""
    engine = server.loop.engine
    cfg = engine.config
    spec = engine.model.config.kv_spec(cfg.kv_dtype)
    lines = [f"model {args.model} ({engine.model.config.arch}, {spec.bytes_per_token:,} KV bytes/token) "
             f"served as {server.model_name!r}, tokenizer {server.tokenizer.name}, device {cfg.device}",
             f"cache {cfg.mode}, page {cfg.page_size} tokens: L1 {engine.device_pool.num_slots:,} tokens "
             f"({engine.device_pool.num_slots * spec.bytes_per_token / 2**20:,.1f} MiB)"]
    if engine.cache.host_pool is not None:
        staging = engine.cache.config.staging_tokens  # the pool's extra chunk for exclusive chunked loads
        host = engine.cache.host_pool.num_slots - staging
        tiers = f"{cfg.tier_mode} with {staging:,} tokens of staging" if staging else cfg.tier_mode
        lines[-1] += (f", L2 {host:,} tokens ({host * spec.bytes_per_token / 2**20:,.1f} MiB, {tiers}, "
                      f"{cfg.write_policy}, {engine.cache.host_pool.layout} layout, {cfg.io_backend} copies)")
    lines[-1] += f"; eviction {cfg.eviction_policy}"
    if engine.cache.storage is not None:
        lines.append(l3_summary(engine))
    tenants = "off (one shared cache; clients may pass cache_salt)" if server.api_keys is None else \
        f"{len(set(server.api_keys.values()))} tenant(s), API key required"
    lines.append(f"tenants {tenants}; body limit {server.limits.max_body_bytes:,} B, read timeout "
                 f"{server.limits.read_timeout_s:g} s, max {server.limits.max_connections} connections, "
                 f"{server.limits.max_waiting_requests} waiting")
    lines.append(f"listening on http://{args.host}:{server.port}")
    return lines


def l3_summary(engine) -> str:
    """L3's store, prefetch policy and cost model, and the counters of its decisions so far (the banner
    shows them at start, the exit line at the end): where L3 hits went when there are none."""
    from tierkv.engine.prefetch import l3_counters
    from tierkv.storage.factory import redact_spec

    storage, cfg = engine.cache.storage, engine.config
    rate = f"{cfg.prefill_tokens_per_s:g} tokens/s (fixed)" if cfg.prefill_tokens_per_s else "measured"
    if not cfg.cost_aware:
        rate = "off (every hit fetched)"
    counters = ", ".join(f"{name} {value}" for name, value in l3_counters(engine.cache).items())
    return (f"L3 {redact_spec(cfg.l3)}: prefetch threshold {storage.config.prefetch_threshold} tokens, stop "
            f"policy {storage.config.prefetch_stop_policy}, at most {storage.max_tokens_in_flight:,} tokens in "
            f"flight; cost model prefill rate {rate}; L3 decisions: {counters}")


def serve_main(argv: list[str] | None = None) -> int:
    return run_serve(serve_parser().parse_args(argv))


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = _build_server(args)
    except (ValueError, OSError) as exc:
        print(f"tierkv serve: error: {exc}", file=sys.stderr)
        return 2
    for line in startup_summary(server, args):
        print(f"tierkv serve: {line}", flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal: end with exit status 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if server.loop.engine.cache.storage is not None:
            print(f"tierkv serve: at exit: {l3_summary(server.loop.engine)}", flush=True)
        server.close()
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def bench_main(argv: list[str] | None = None) -> int:
    """``tierkv bench engine ARGS`` as a function (``python -m tierkv.engine.cli bench ARGS``)."""
    return bench.main(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m tierkv.engine.cli serve|bench ...``: the engine's commands without ``tierkv``."""
    parser = argparse.ArgumentParser(prog="python -m tierkv.engine.cli", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub, SERVE_DESCRIPTION)
    _add_engine_bench(sub, "bench", "the engine benchmark (as `tierkv bench engine`)")
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
