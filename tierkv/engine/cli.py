"""Command lines: ``tierkv serve`` and ``tierkv bench engine`` (dispatched here by tierkv.cli)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from tierkv.engine.engine import CACHE_MODES, Engine, EngineConfig


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device for model and L1 (cpu, cuda, cuda:1)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="prompt tokens prefilled per step")
    parser.add_argument("--max-running", type=int, default=16, help="requests batched together")


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierkv serve", description="OpenAI-compatible completions server.")
    parser.add_argument("--model", required=True, help="preset name (tiny-llama, ...), config.json or checkpoint dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--mode", choices=CACHE_MODES, default="l1+l2")
    parser.add_argument("--l1-tokens", type=int, default=8192)
    parser.add_argument("--l3", default=None, help="storage spec for mode l1+l2+l3, e.g. file:/tmp/kv")
    parser.add_argument("--storage-extra", default=None, help="JSON extra config for the L3 tier")
    parser.add_argument("--model-id", default=None,
                        help="a name added to the model's L3 namespace (which always digests config and weights)")
    _engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tierkv.engine.server import CompletionServer
    try:
        extra = json.loads(args.storage_extra) if args.storage_extra else None
        config = EngineConfig(mode=args.mode, device=args.device, l1_tokens=args.l1_tokens, page_size=args.page_size,
                              l3=args.l3, storage_extra=extra, max_running_requests=args.max_running,
                              chunk_tokens=args.chunk_tokens, model_id=args.model_id)
        engine = Engine(args.model, config)
        server = CompletionServer(engine, args.host, args.port, model_name=args.model)
    except (ValueError, OSError) as exc:
        print(f"tierkv serve: {exc}", file=sys.stderr)
        return 2
    print(f"tierkv serve: {args.model} ({args.mode}) listening on http://{args.host}:{server.port}", flush=True)
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
