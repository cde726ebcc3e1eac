"""``tierkv serve``'s cache flags, under tierkv's names and SGLang HiCache's, and the EngineConfig they make.

A HiCache user's command line works as it is: each ``--hicache-*`` flag (and ``--page-size``,
``--radix-eviction-policy``, ``--max-running-requests``, ``--chunked-prefill-size``) maps onto the same
engine or cache field as tierkv's own flag; a value SGLang accepts and tierkv does not implement is
refused naming what is supported. Every flag given takes effect or is refused: a tier flag without its
tier (``--l3`` with ``--mode l1+l2``, ``--hicache-ratio`` with ``--mode l1``) is an error, not ignored.
The table of names is in docs/serve.md ("SGLang HiCache flags on `tierkv serve`").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tierkv.cli_args import token_count
from tierkv.cache.config import IO_BACKENDS, TIER_MODES, WRITE_POLICIES, CacheConfig
from tierkv.engine.engine import CACHE_MODES, EngineConfig
from tierkv.eviction import POLICIES
from tierkv.pools.kv import HOST_LAYOUTS
from tierkv.storage.config import STOP_POLICIES

DEFAULT_L1_TOKENS = "8k"
L2_MODES = ("l1+l2", "l1+l2+l3")
SGLANG_FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # `--hicache-storage-backend file`'s directory
# SGLang's values tierkv does not implement, with why (server_args.py's choices, 2026)
SGLANG_ONLY = {
    "--hicache-io-backend": {"kernel_ascend": "Ascend NPUs"},
    "--hicache-mem-layout": {"page_first_kv_split": "split K/V page layout",
                             "page_head": "per-head page layout"},
    "--hicache-storage-backend": {name: "storage backend" for name in
                                  ("hf3fs", "nixl", "aibrix", "dynamic", "eic", "simm", "mori", "shm", "sim")},
}


class CliError(ValueError):
    """A bad command-line value; the message names the flag."""


def _supported(flag: str, supported: tuple[str, ...]):
    """argparse type: one of ``supported``; SGLang's other values get a message saying tierkv lacks them."""
    def parse(text: str) -> str:
        if text in supported:
            return text
        what = SGLANG_ONLY.get(flag, {}).get(text)
        reason = f"SGLang's {what} {text!r} is not implemented by tierkv" if what else f"{text!r} is not known"
        raise argparse.ArgumentTypeError(f"{reason}; supported: {', '.join(supported)}")
    return parse


def storage_spec(text: str) -> str:
    """argparse type for --l3 / --hicache-storage-backend: a tierkv store spec (file:DIR, redis://..., or a
    bare backend name whose address comes from the extra config); SGLang-only backends are refused."""
    what = SGLANG_ONLY["--hicache-storage-backend"].get(text)
    if what:
        raise argparse.ArgumentTypeError(
            f"SGLang's {what} {text!r} is not implemented by tierkv; use file:DIR, file (with \"dir\" in the "
            "extra config), redis://HOST:PORT/DB, redis+cluster://HOST:PORT, mooncake://HOST:PORT or memory")
    if not text:
        raise argparse.ArgumentTypeError("empty storage spec")
    return text


def chunk_size(text: str) -> int:
    """argparse type for --chunk-tokens / --chunked-prefill-size: tokens >= 1, or -1 (SGLang: no chunking)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1, or -1 for whole prompts")
    return value


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The cache, L3 and scheduler flags of ``tierkv serve`` (tierkv's names first, SGLang's aliases)."""
    tiers = parser.add_argument_group("cache tiers (SGLang HiCache's names accepted)")
    tiers.add_argument("--mode", choices=CACHE_MODES, default=None,
                       help="cache tiers: none, l1 (device), l1+l2 (+host), l1+l2+l3 (+storage) "
                            "(default: l1+l2, or l1+l2+l3 when --l3 is given)")
    tiers.add_argument("--enable-hierarchical-cache", action="store_true",
                       help="HiCache's switch: L1+L2 tiers (L1+L2+L3 with a storage backend); tierkv's default")
    tiers.add_argument("--l1-tokens", type=token_count, default=DEFAULT_L1_TOKENS, help="L1 (device) tokens")
    tiers.add_argument("--l2-tokens", type=token_count, default=None,
                       help="L2 (host) tokens (default: --hicache-ratio x L1)")
    tiers.add_argument("--hicache-ratio", type=float, default=None,
                       help="L2 size as a multiple of L1, > 1 (default: 2.0, as HiCache)")
    tiers.add_argument("--hicache-size", type=float, default=None, metavar="GB",
                       help="L2 size in GB (1e9 bytes of KV); overrides --hicache-ratio, as in HiCache; 0: use "
                            "the ratio")
    tiers.add_argument("--hicache-write-policy", choices=sorted(WRITE_POLICIES), default=None,
                       help="when L1 pages are copied to L2: write_through (on insert), write_through_selective "
                            "(on the second hit), write_back (on L1 eviction) (default: write_through)")
    tiers.add_argument("--hicache-io-backend", type=_supported("--hicache-io-backend", IO_BACKENDS), default=None,
                       metavar="{" + ",".join(IO_BACKENDS) + "}",
                       help=f"L1<->L2 copies: {' or '.join(IO_BACKENDS)} (default: kernel)")
    tiers.add_argument("--hicache-mem-layout", type=_supported("--hicache-mem-layout", HOST_LAYOUTS),
                       default=None, metavar="{" + ",".join(HOST_LAYOUTS) + "}",
                       help=f"L2 memory layout: {', '.join(HOST_LAYOUTS)} (default: layer_first; HiCache's "
                            "default is page_first)")
    tiers.add_argument("--tier-mode", choices=TIER_MODES, default=None,
                       help="inclusive: L2 copies what L1 holds; exclusive: L2 holds what L1 dropped "
                            "(default: inclusive)")
    tiers.add_argument("--eviction-policy", "--radix-eviction-policy", dest="eviction_policy",
                       choices=sorted(POLICIES), default=CacheConfig.eviction_policy, metavar="POLICY",
                       help=f"order in which L1 and L2 pages go: {', '.join(sorted(POLICIES))} (SGLang's lru, lfu, "
                            "slru and priority among them)")
    tiers.add_argument("--page-size", type=int, default=16, help="tokens per cache page (as tierkv replay)")
    l3 = parser.add_argument_group("L3 storage")
    l3.add_argument("--l3", "--hicache-storage-backend", dest="l3", type=storage_spec, default=None,
                    metavar="SPEC",
                    help="storage spec: file:DIR, redis://HOST:PORT/DB, redis+cluster://..., mooncake://HOST:PORT,"
                         " or a bare backend name with its address in the extra config; implies --mode l1+l2+l3")
    l3.add_argument("--storage-extra", "--hicache-storage-backend-extra-config", dest="storage_extra", default=None,
                    metavar="JSON", help="L3 extra config: a JSON object, or @FILE holding one (prefetch "
                                         "thresholds and policy, backend keys)")
    l3.add_argument("--hicache-storage-prefetch-policy", choices=STOP_POLICIES, default=None,
                    help="when an L3 prefetch stops (the extra config's prefetch_stop_policy; default: timeout, "
                         "as HiCache: best_effort lets a request run as soon as it can, which on an idle server "
                         "is before its prefetch has read anything)")
    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-running", "--max-running-requests", dest="max_running", type=int, default=16, metavar="N",
                       help="requests batched together")
    sched.add_argument("--chunk-tokens", "--chunked-prefill-size", dest="chunk_tokens", type=chunk_size,
                       default=256, metavar="TOKENS", help="prompt tokens prefilled per step (-1: whole prompts)")
    sched.add_argument("--prefill-tokens-per-s", type=float, default=None,
                       help="fix the prefill rate the fetch-or-recompute decisions use (default: measured)")


def resolve_mode(args: argparse.Namespace) -> str:
    """The cache mode the flags ask for; a flag whose tier the mode lacks is an error."""
    mode = args.mode or ("l1+l2+l3" if args.l3 else "l1+l2")
    if args.l3 and mode != "l1+l2+l3":
        raise CliError(f"--l3 is given but --mode {mode} has no L3 tier: drop --mode or use --mode l1+l2+l3")
    if args.enable_hierarchical_cache and mode not in L2_MODES:
        raise CliError(f"--enable-hierarchical-cache asks for an L2 tier, but --mode {mode} has none")
    l2_flags = [flag for flag, value in (("--l2-tokens", args.l2_tokens), ("--hicache-ratio", args.hicache_ratio),
                                         ("--hicache-size", args.hicache_size),
                                         ("--hicache-write-policy", args.hicache_write_policy),
                                         ("--hicache-io-backend", args.hicache_io_backend),
                                         ("--hicache-mem-layout", args.hicache_mem_layout),
                                         ("--tier-mode", args.tier_mode)) if value is not None]
    if l2_flags and mode not in L2_MODES:
        raise CliError(f"{', '.join(l2_flags)} set the L2 tier, which --mode {mode} does not have")
    l3_flags = [flag for flag, value in (("--storage-extra", args.storage_extra),
                                         ("--hicache-storage-prefetch-policy", args.hicache_storage_prefetch_policy))
                if value is not None]
    if l3_flags and mode != "l1+l2+l3":
        raise CliError(f"{', '.join(l3_flags)} configure L3, which --mode {mode} does not have: add --l3 SPEC")
    return mode


def storage_extra(args: argparse.Namespace) -> dict | None:
    """The L3 extra config as a dict. Errors never show the text: it may hold a password or page key."""
    text = args.storage_extra
    if text is not None and text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--storage-extra {text}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        extra = json.loads(text) if text else None
    except json.JSONDecodeError as exc:
        raise CliError(f"--storage-extra: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if extra is not None and not isinstance(extra, dict):
        raise CliError(f"--storage-extra: expected a JSON object, got a JSON {type(extra).__name__} (value not shown)")
    policy = args.hicache_storage_prefetch_policy
    if policy is not None and (extra or {}).get("prefetch_stop_policy", policy) != policy:
        raise CliError("--hicache-storage-prefetch-policy and the extra config's prefetch_stop_policy differ")
    if policy is not None:  # without one, the engine's default (HiCache's timeout: attach_l3)
        extra = dict(extra or {}, prefetch_stop_policy=policy)
    if args.l3 == "file" and "dir" not in (extra or {}) and os.environ.get(SGLANG_FILE_DIR_ENV):
        extra = dict(extra or {}, dir=os.environ[SGLANG_FILE_DIR_ENV])  # where SGLang's own file backend looks
    return extra


def _l2_sizes(args: argparse.Namespace) -> tuple[float, float | None]:
    """(hicache_ratio, hicache_size_gb) from --l2-tokens, --hicache-ratio or --hicache-size (one way only)."""
    if args.l2_tokens is not None and (args.hicache_ratio is not None or args.hicache_size is not None):
        raise CliError("--l2-tokens and --hicache-ratio / --hicache-size both size L2: give one")
    if args.l2_tokens is not None:
        if args.l2_tokens <= args.l1_tokens:
            raise CliError(f"--l2-tokens {args.l2_tokens} must be larger than --l1-tokens {args.l1_tokens}")
        return args.l2_tokens / args.l1_tokens, None
    if args.hicache_ratio is not None and not args.hicache_ratio > 1:
        raise CliError(f"--hicache-ratio {args.hicache_ratio} must be > 1 (L2 larger than L1)")
    if args.hicache_size is not None and not args.hicache_size >= 0:
        raise CliError(f"--hicache-size {args.hicache_size} must be a number of GB >= 0")
    return args.hicache_ratio or 2.0, args.hicache_size or None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig ``tierkv serve``'s flags describe; CliError naming the flag for a bad or
    conflicting value. Checks the device can run a model (tierkv.engine.loader.check_device)."""
    from tierkv.engine.loader import check_device

    mode = resolve_mode(args)
    extra = storage_extra(args)
    try:
        check_device(args.device)
    except ValueError as exc:
        raise CliError(f"--device {args.device}: {exc}") from None
    ratio, size_gb = _l2_sizes(args) if mode in L2_MODES else (2.0, None)
    chunk_tokens = args.l1_tokens if args.chunk_tokens == -1 else args.chunk_tokens
    fields = dict(mode=mode, device=args.device, l1_tokens=args.l1_tokens, page_size=args.page_size,
                  hicache_ratio=ratio, hicache_size_gb=size_gb, l3=args.l3, storage_extra=extra,
                  max_running_requests=args.max_running, chunk_tokens=chunk_tokens, model_id=args.model_id,
                  prefill_tokens_per_s=args.prefill_tokens_per_s, eviction_policy=args.eviction_policy,
                  tier_mode=args.tier_mode or CacheConfig.tier_mode,
                  write_policy=args.hicache_write_policy or "write_through",
                  host_layout=args.hicache_mem_layout or "layer_first", io_backend=args.hicache_io_backend or "kernel")
    try:
        return EngineConfig(**fields)
    except ValueError as exc:
        raise CliError(_name_flag(str(exc))) from None


_FLAGS = {"l1_tokens": "--l1-tokens", "page_size": "--page-size", "mode": "--mode", "l3": "--l3",
          "max_running_requests": "--max-running", "chunk_tokens": "--chunk-tokens",
          "prefill_tokens_per_s": "--prefill-tokens-per-s", "hicache_size_gb": "--hicache-size",
          "hicache_ratio": "--hicache-ratio"}


def _name_flag(message: str) -> str:
    """``l1_tokens must ...`` -> ``--l1-tokens: l1_tokens must ...`` for the config fields that are flags."""
    for field_name, flag in _FLAGS.items():
        if message.startswith(field_name) or f"'{field_name}'" in message or f" {field_name} " in message:
            return f"{flag}: {message}"
    return message
