"""L3 throughput per backend (GB/s) beside a raw baseline of the same bytes, run side by side.

Pages are 64 tokens of a Llama-3-8B-sized KV (128 KiB per token -> 8 MiB). Baselines:
  memory    plain copies of the page bytes into a dict (bytes(page)) and back (torch copy)
  file      plain sequential write (one file per page, same fsync policy) / readinto the same target
  redis     raw redis-py pipelined SET/GET of the same values, same pages per round trip
  mooncake  raw client batch_put_from / batch_get_into of the same bytes
Each side runs ``--repeats`` times, in turns; the best time of each counts. Target ratio >= 0.7.
The raw sides verify nothing; tierkv checksums every page (xxh3-64) on write and on read, which is a
whole extra memory pass where the transport itself is a memory copy (memory, mooncake on one host).
``--page-key`` runs the stores with page authentication (a keyed MAC, HMAC-SHA256, instead of xxh3).
A first table compares the digests alone on the same pages, side by side: xxh3-64 (the baseline),
HMAC-SHA256 (what ``page_key`` uses) and keyed BLAKE2b, each fed in the stores' 256 KiB chunks.

    python bench/bench_storage.py [--pages 64] [--backends memory,file,redis,mooncake] [--fsync] [--cold]
                                  [--page-key SECRET]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tierkv.hashing import HashNamespace, page_hashes  # noqa: E402
from tierkv.storage.factory import open_store  # noqa: E402
from tierkv.storage.page_format import CHUNK_NBYTES  # noqa: E402

TOKEN_NBYTES = 128 << 10
PAGE_TOKENS = 64


def best_seconds(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Case:
    """One backend: its store, the raw baseline's write and read, and the cleanup between runs."""

    def __init__(self, name: str, store, raw_set, raw_get, reset) -> None:
        self.name, self.store, self.raw_set, self.raw_get, self.reset = name, store, raw_set, raw_get, reset
        self.before_get: Callable[[], object] | None = None
        self.cleanup: Callable[[], object] = lambda: None


def store_options(args) -> dict:
    return {"page_key": args.page_key} if args.page_key else {}


def memory_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    store = open_store("memory", ns, page_nbytes, store_options(args))
    raw: dict = {}

    def raw_set():
        for k, p in zip(keys, pages):
            raw[k] = bytes(p.numpy())

    def raw_get():
        for k, t in zip(keys, targets):
            np.copyto(t.numpy(), np.frombuffer(raw[k], dtype=np.uint8))
    return Case("memory", store, raw_set, raw_get, lambda: (store.clear(), raw.clear()))


def file_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    root = tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir)
    store = open_store(f"file://{root}/store", ns, page_nbytes, {"fsync": args.fsync, **store_options(args)})
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir)

    def raw_set():
        for k, p in zip(keys, pages):
            with open(os.path.join(raw_dir, k), "wb") as f:
                f.write(p.numpy())
                if args.fsync:
                    os.fsync(f.fileno())

    def raw_get():
        for k, t in zip(keys, targets):
            with open(os.path.join(raw_dir, k), "rb", buffering=0) as f:
                f.readinto(t.numpy())

    def reset():
        store.clear()
        shutil.rmtree(raw_dir)
        os.makedirs(raw_dir)

    def drop_page_cache():
        for directory, _, names in os.walk(root):
            for name in names:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    case = Case("file", store, raw_set, raw_get, reset)
    case.cleanup = lambda: shutil.rmtree(root, ignore_errors=True)
    if args.cold:
        case.before_get = drop_page_cache
    return case


def redis_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    import redis
    from tests.servers import RedisServer
    server = RedisServer.start()
    store = open_store(server.url, ns, page_nbytes, {"batch_pages": args.batch_pages, "timeout_s": 60.0,
                                                     **store_options(args)})
    client = redis.Redis(port=server.port, socket_timeout=60.0)
    raw_keys = [f"raw:{k}" for k in keys]
    got: list = []

    def pipelined(command: str, arg_lists: list[tuple]) -> list:
        replies = []
        for start in range(0, len(arg_lists), args.batch_pages):
            pipe = client.pipeline(transaction=False)
            for one in arg_lists[start:start + args.batch_pages]:
                pipe.execute_command(command, *one)
            replies += pipe.execute()
        return replies

    def raw_set():
        pipelined("SET", [(k, p.numpy().data) for k, p in zip(raw_keys, pages)])

    def raw_get():
        got[:] = pipelined("GET", [(k,) for k in raw_keys])

    def reset():
        store.clear()
        client.delete(*raw_keys)
    case = Case("redis", store, raw_set, raw_get, reset)
    case.cleanup = server.stop
    return case


def mooncake_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    from tests.servers import MooncakeMaster
    master = MooncakeMaster.start()
    segment = 3 * len(pages) * (page_nbytes + 4096)  # store + raw copies, with allocator slack
    config = {**master.client_config(), "global_segment_size": segment, "local_buffer_size": 64 << 20,
              **store_options(args)}
    store = open_store(master.url, ns, page_nbytes, config)
    store.batch_exists(keys[:1])  # set up the client outside the timed region
    client = store.client
    raw_keys = [f"raw:{k}" for k in keys]
    sizes = [page_nbytes] * len(keys)

    def raw_set():
        codes = client.batch_put_from(raw_keys, [p.data_ptr() for p in pages], sizes)
        assert all(c == 0 for c in codes), codes

    def raw_get():
        client.batch_get_into(raw_keys, [t.data_ptr() for t in targets], sizes)

    def reset():
        store.clear()
        client.remove_by_regex("^raw:", True)
    case = Case("mooncake", store, raw_set, raw_get, reset)
    case.cleanup = lambda: (store.close(), master.stop())
    return case


CASES = {"memory": memory_case, "file": file_case, "redis": redis_case, "mooncake": mooncake_case}


def alternate(ours: Callable[[], object], raw: Callable[[], object], repeats: int,
              before: Callable[[], object] | None = None) -> tuple[float, float]:
    """Best seconds of each side, run in turns (swapping who goes first) so both see the same load."""
    best = [float("inf"), float("inf")]
    for rep in range(repeats):
        order = [0, 1] if rep % 2 == 0 else [1, 0]
        for side in order:
            best[side] = min(best[side], best_seconds((ours, raw)[side], 1, before))
    return best[0], best[1]


def run_case(case: Case, keys, pages, targets, repeats: int) -> list[tuple]:
    nbytes = len(pages) * pages[0].numel()
    store = case.store
    set_store, set_raw = alternate(lambda: store.batch_set(keys, pages), case.raw_set, repeats, case.reset)
    case.reset()
    if not all(store.batch_set(keys, pages)):
        raise RuntimeError(f"{case.name}: writes failed ({store.stats.errors} errors)")
    case.raw_set()
    get_store, get_raw = alternate(lambda: store.batch_get(keys, targets), case.raw_get, repeats,
                                   case.before_get)
    found = store.batch_get(keys, targets)
    if not all(found) or not all(torch.equal(t, p) for t, p in zip(targets, pages)):
        raise RuntimeError(f"{case.name}: read-back mismatch (found {sum(found)}/{len(found)})")
    return [(case.name, op, nbytes / ours / 1e9, nbytes / raw / 1e9, raw / ours)
            for op, ours, raw in (("set", set_store, set_raw), ("get", get_store, get_raw))]


DIGESTS: dict[str, Callable[[], object]] = {
    "xxh3-64": xxhash.xxh3_64,
    "hmac-sha256": lambda: hmac.new(b"k" * 32, digestmod=hashlib.sha256),
    "blake2b-keyed": lambda: hashlib.blake2b(key=b"k" * 32, digest_size=16),
}


def digest_rows(pages, repeats: int) -> list[tuple[str, float, float]]:
    """(digest, GB/s, fraction of xxh3's speed): every page fed in chunks, digests run in turns."""
    views = [memoryview(p.numpy()) for p in pages]

    def run(make) -> None:
        for view in views:
            state = make()
            for start in range(0, len(view), CHUNK_NBYTES):
                state.update(view[start:start + CHUNK_NBYTES])
            state.digest()
    best = dict.fromkeys(DIGESTS, float("inf"))
    for rep in range(repeats):
        names = list(DIGESTS) if rep % 2 == 0 else list(DIGESTS)[::-1]
        for name in names:
            best[name] = min(best[name], best_seconds(lambda: run(DIGESTS[name]), 1))
    nbytes = sum(len(v) for v in views)
    return [(name, nbytes / best[name] / 1e9, best["xxh3-64"] / best[name]) for name in DIGESTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-tokens", type=int, default=PAGE_TOKENS)
    parser.add_argument("--backends", default="memory,file,redis,mooncake")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-pages", type=int, default=8, help="redis pages per pipeline round trip")
    parser.add_argument("--fsync", action="store_true", help="fsync every page (both sides)")
    parser.add_argument("--dir", default=None, help="parent directory for the file backend")
    parser.add_argument("--cold", action="store_true",
                        help="file: drop both sides' pages from the page cache before each read run")
    parser.add_argument("--page-key", default=None, help="authenticate pages with this secret (a MAC)")
    parser.add_argument("--skip-digests", action="store_true", help="no digest table")
    args = parser.parse_args()
    page_nbytes = args.page_tokens * TOKEN_NBYTES
    ns = HashNamespace(model="llama-3-8b", kv_dtype="bfloat16", kv_shape=(2, 32, 8, 128))
    keys = page_hashes(list(range(args.pages * args.page_tokens)), args.page_tokens, None, ns)
    gen = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=gen) for _ in keys]
    targets = [torch.ones(page_nbytes, dtype=torch.uint8) for _ in keys]  # touched up front
    print(f"{args.pages} pages x {page_nbytes >> 20} MiB ({args.page_tokens} tokens x 128 KiB), "
          f"best of {args.repeats}, fsync={args.fsync}, cold={args.cold}, page_key={bool(args.page_key)}")
    if not args.skip_digests:
        print(f"{'digest':<14} {'GB/s':>6} {'vs xxh3':>8}")
        for name, gbps, ratio in digest_rows(pages, args.repeats):
            print(f"{name:<14} {gbps:>6.2f} {ratio:>8.3f}")
    rows = []
    for name in args.backends.split(","):
        try:
            case = CASES[name](ns.name(), page_nbytes, keys, pages, targets, args)
        except Exception as err:  # a missing server skips the row, the table still prints
            print(f"{name}: skipped ({type(err).__name__}: {err})")
            continue
        try:
            rows += run_case(case, keys, pages, targets, args.repeats)
        except RuntimeError as err:
            print(f"{name}: FAILED ({err})")
        finally:
            case.reset()
            case.cleanup()
    print(f"{'backend':<9} {'op':<4} {'tierkv GB/s':>11} {'raw GB/s':>9} {'ratio':>6}")
    for name, op, ours, raw, ratio in rows:
        flag = "" if ratio >= 0.7 else "  < 0.7"
        print(f"{name:<9} {op:<4} {ours:>11.2f} {raw:>9.2f} {ratio:>6.2f}{flag}")


if __name__ == "__main__":
    main()
