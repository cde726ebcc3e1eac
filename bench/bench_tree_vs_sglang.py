"""Radix tree microbenchmark: tierkv's RadixTree against SGLang's own Python RadixCache, side by side.

Both trees get the same sequence: for each request, match its key, then insert it with a value tensor of
slot ids (a scheduler's pattern: one key object per request, used for both). Workloads:
- ``trace``: the first N prompts of conversation_trace.jsonl (12k tokens on average), page size 16;
- ``chat``: short multi-turn keys (64-1024 tokens, shared system prompts), page size 1.

SGLang needs its own environment; `bash scripts/setup_sglang_venv.sh` builds it (.venv-sglang, sharing
tierkv's torch; a torchvision stand-in is written to a temp dir when ``torchvision`` is missing). Run:
    PYTHONPATH=. .venv-sglang/bin/python bench/bench_tree_vs_sglang.py
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierkv.replay.trace import load_trace
from tierkv.radix import RadixKey, RadixTree

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl.gz"  # shipped with the repository

_TORCHVISION_STUB = '''
import importlib.abc, importlib.machinery, sys, types
__version__ = "0.0.0"
class _AnyAttr(type):
    def __getattr__(cls, name):
        return cls
class _Missing(metaclass=_AnyAttr):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision stand-in")
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    def create_module(self, spec):
        m = types.ModuleType(spec.name); m.__path__ = []; m.__getattr__ = __getattr__; return m
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Finder())
'''


def import_sglang():
    """SGLang's RadixCache module, with a torchvision stand-in on sys.path when there is none."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        stub = Path(tempfile.mkdtemp(prefix="tvstub")) / "torchvision"
        stub.mkdir()
        (stub / "__init__.py").write_text(_TORCHVISION_STUB)
        sys.path.insert(0, str(stub.parent))
    import logging

    logging.disable(logging.WARNING)
    from sglang.srt.mem_cache import radix_cache
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    return radix_cache, InsertParams, MatchPrefixParams


def trace_workload(path: str, n: int) -> list[list[int]]:
    return [r.prompt_tokens() for r in load_trace(path, limit=n).requests]


def chat_workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(rng.randrange(64, 256))] for _ in range(8)]
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.7:
            conv = rng.choice(convs)
            conv.extend(rng.randrange(32000) for _ in range(rng.randrange(16, 128)))
            if len(conv) > 1024:
                convs.remove(conv)
        else:
            conv = list(rng.choice(systems)) + [rng.randrange(32000) for _ in range(rng.randrange(16, 128))]
            convs.append(conv)
        out.append(list(conv))
    return out


def run_tierkv(seqs: list[list[int]], page_size: int) -> tuple[float, float]:
    tree = RadixTree(page_size)
    values = [torch.arange(len(s), dtype=torch.int64) for s in seqs]
    match_s = insert_s = 0.0
    for seq, value in zip(seqs, values):
        key = RadixKey(seq)
        t0 = time.perf_counter()
        tree.match(key)
        t1 = time.perf_counter()
        tree.insert(key, value)
        insert_s += time.perf_counter() - t1
        match_s += t1 - t0
    return match_s, insert_s


def run_sglang(seqs: list[list[int]], page_size: int, sgl) -> tuple[float, float]:
    radix_cache, InsertParams, MatchPrefixParams = sgl
    cache = radix_cache.RadixCache.create_simulated(page_size=page_size)
    values = [torch.arange(len(s), dtype=torch.int64) for s in seqs]
    match_s = insert_s = 0.0
    for seq, value in zip(seqs, values):
        key = radix_cache.RadixKey(seq)
        t0 = time.perf_counter()
        cache.match_prefix(MatchPrefixParams(key=key))
        t1 = time.perf_counter()
        cache.insert(InsertParams(key=key, value=value))
        insert_s += time.perf_counter() - t1
        match_s += t1 - t0
    return match_s, insert_s


def best_of_interleaved(fns, repeats: int) -> list[tuple[float, float]]:
    """Each function ``repeats`` times, alternating, so a busy spell of the machine hits both alike;
    per function the shortest (match, insert) seconds."""
    runs = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, runs):
            out.append(fn())
    return [(min(r[0] for r in out), min(r[1] for r in out)) for out in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--trace-requests", type=int, default=1000)
    parser.add_argument("--chat-requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sgl = import_sglang()
    import sglang

    rows = []
    for name, seqs, page in (("trace p16", trace_workload(args.trace, args.trace_requests), 16),
                             ("chat p1", chat_workload(args.chat_requests), 1)):
        tk, sg = best_of_interleaved([lambda: run_tierkv(seqs, page), lambda: run_sglang(seqs, page, sgl)],
                                     args.repeats)
        n = len(seqs)
        for op, i in (("match", 0), ("insert", 1)):
            rows.append((name, op, n / sg[i], n / tk[i], sg[i] / tk[i]))
        rows.append((name, "match+insert", n / sum(sg), n / sum(tk), sum(sg) / sum(tk)))
    print(f"tierkv RadixTree vs SGLang {sglang.__version__} RadixCache (same sequence, best of {args.repeats} interleaved)")
    print(f"{'workload':<11} {'op':<13} {'sglang ops/s':>13} {'tierkv ops/s':>13} {'ratio':>7}")
    for name, op, sg_ops, tk_ops, ratio in rows:
        print(f"{name:<11} {op:<13} {sg_ops:>13,.0f} {tk_ops:>13,.0f} {ratio:>6.2f}x")


if __name__ == "__main__":
    main()
