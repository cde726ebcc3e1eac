"""Command lines: ``tierkv serve`` and ``tierkv bench engine`` (dispatched here by tierkv.cli)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from tierkv.cli import token_count
from tierkv.cache.config import TIER_MODES, CacheConfig
from tierkv.engine.config import PRESETS
from tierkv.engine.engine import CACHE_MODES, Engine, EngineConfig
from tierkv.eviction import POLICIES

DEFAULT_L1_TOKENS = "8k"


class CliError(ValueError):
    """A bad command-line value; the message names the flag."""


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside [0, 65535]")
    return port


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device for model and L1 (cpu, cuda, cuda:1)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per cache page (as tierkv replay)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="prompt tokens prefilled per step")
    parser.add_argument("--max-running", type=int, default=16, help="requests batched together")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None,
                        help="fix the prefill rate the fetch-or-recompute decisions use (default: measured)")
    parser.add_argument("--tier-mode", choices=TIER_MODES, default="inclusive",
                        help="inclusive: L2 copies what L1 holds; exclusive: L2 holds what L1 dropped")
    parser.add_argument("--eviction-policy", choices=sorted(POLICIES), default=CacheConfig.eviction_policy,
                        help="order in which L1 and L2 pages go")


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="OpenAI-compatible completions and chat server with the tiered "
                                                 "prefix cache.")
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}: random weights, text output is noise), a config.json, "
                             "or a checkpoint directory (its own tokenizer when it has one)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as `model` "
                                                                   "(default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    parser.add_argument("--mode", choices=CACHE_MODES, default="l1+l2")
    parser.add_argument("--l1-tokens", type=token_count, default=DEFAULT_L1_TOKENS, help="L1 (device) tokens")
    parser.add_argument("--l2-tokens", type=token_count, default=None, help="L2 (host) tokens (default 2x L1)")
    parser.add_argument("--l3", default=None, help="storage spec for mode l1+l2+l3, e.g. file:/tmp/kv")
    parser.add_argument("--storage-extra", default=None, help="JSON extra config for the L3 tier")
    parser.add_argument("--model-id", default=None,
                        help="a name added to the model's L3 namespace (which always digests config and weights)")
    parser.add_argument("--api-key", default=None, help="require this API key (one tenant)")
    parser.add_argument("--tenant-keys", default=None, metavar="FILE",
                        help="file of `TENANT KEY` lines: each key's requests get their own cache namespace")
    parser.add_argument("--read-timeout-s", type=float, default=30.0, help="time a client has to send a request")
    parser.add_argument("--max-connections", type=int, default=1024, help="open connections beyond are refused")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests queued for admission beyond are answered 429 with Retry-After")
    _engine_args(parser)
    return parser


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


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        extra = json.loads(args.storage_extra) if args.storage_extra else None
    except json.JSONDecodeError as exc:
        raise CliError(f"--storage-extra: not valid JSON: {exc}") from None
    if extra is not None and not isinstance(extra, dict):
        raise CliError(f"--storage-extra: expected a JSON object, got {args.storage_extra!r}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError(f"--device {args.device}: CUDA is not available on this machine")
    if args.l2_tokens is not None and args.l2_tokens <= args.l1_tokens:
        raise CliError(f"--l2-tokens {args.l2_tokens} must be larger than --l1-tokens {args.l1_tokens}")
    ratio = args.l2_tokens / args.l1_tokens if args.l2_tokens else 2.0
    try:
        return EngineConfig(mode=args.mode, device=args.device, l1_tokens=args.l1_tokens, page_size=args.page_size,
                            hicache_ratio=ratio, l3=args.l3, storage_extra=extra,
                            max_running_requests=args.max_running, chunk_tokens=args.chunk_tokens,
                            model_id=args.model_id, prefill_tokens_per_s=args.prefill_tokens_per_s,
                            tier_mode=args.tier_mode, eviction_policy=args.eviction_policy)
    except ValueError as exc:
        raise CliError(_name_flag(str(exc))) from None


def _name_flag(message: str) -> str:
    """``l1_tokens must ...`` -> ``--l1-tokens: l1_tokens must ...`` for the config fields that are flags."""
    for field_name in ("l1_tokens", "page_size", "mode", "l3", "max_running_requests", "chunk_tokens",
                       "prefill_tokens_per_s"):
        if message.startswith(field_name) or f"'{field_name}'" in message or f" {field_name} " in message:
            flag = {"max_running_requests": "max-running"}.get(field_name, field_name.replace("_", "-"))
            return f"--{flag}: {message}"
    return message


def _build_server(args: argparse.Namespace):
    try:
        from tierkv.engine.server import CompletionServer, ServerLimits
    except ModuleNotFoundError as exc:
        raise CliError(f"serving needs {exc.name}: pip install 'tierkv-hicache[serve]'") from None
    from tierkv.engine.tokenizer import load_tokenizer

    config = _engine_config(args)
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
    """What a operator needs to know at a glance: model, tiers with sizes, namespaces, limits, address."""
    engine = server.loop.engine
    spec = engine.model.config.kv_spec(engine.config.kv_dtype)
    lines = [f"model {args.model} ({engine.model.config.arch}, {spec.bytes_per_token:,} KV bytes/token) "
             f"served as {server.model_name!r}, tokenizer {server.tokenizer.name}, device {engine.config.device}",
             f"cache {args.mode}, page {engine.config.page_size} tokens: L1 {engine.device_pool.num_slots:,} tokens "
             f"({engine.device_pool.num_slots * spec.bytes_per_token / 2**20:,.1f} MiB)"]
    if engine.cache.host_pool is not None:
        host = engine.cache.host_pool.num_slots
        lines[-1] += f", L2 {host:,} tokens ({host * spec.bytes_per_token / 2**20:,.1f} MiB, {engine.config.tier_mode})"
    lines[-1] += f"; eviction {engine.config.eviction_policy}"
    if args.l3:
        from tierkv.storage.factory import redact_spec

        lines[-1] += f", L3 {redact_spec(args.l3)}"
    tenants = "off (one shared cache; clients may pass cache_salt)" if server.api_keys is None else \
        f"{len(set(server.api_keys.values()))} tenant(s), API key required"
    lines.append(f"tenants {tenants}; body limit {server.limits.max_body_bytes:,} B, read timeout "
                 f"{server.limits.read_timeout_s:g} s, max {server.limits.max_connections} connections, "
                 f"{server.limits.max_waiting_requests} waiting")
    lines.append(f"listening on http://{args.host}:{server.port}")
    return lines


def serve_main(argv: list[str] | None = None) -> int:
    args = serve_parser().parse_args(argv)
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
        server.close()
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def bench_main(argv: list[str] | None = None) -> int:
    from tierkv.engine.bench import main
    return main(argv)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "serve":
        sys.exit(serve_main(sys.argv[2:]))
    if command == "bench":
        sys.exit(bench_main(sys.argv[2:]))
    print("usage: python -m tierkv.engine.cli {serve|bench} ...", file=sys.stderr)
    sys.exit(2)
