"""Radix tree microbenchmark: tierkv's RadixTree against SGLang's own Python RadixCache, side by side.

Both trees get the same sequence, token ids as ``array('q')`` as SGLang's scheduler holds them (its
tokenizer manager builds one per request). Per request: build the key, match it, evict what the
uncached suffix needs beyond the capacity, insert it with a value tensor of slot ids. Phases:
- ``cold``: no capacity limit (the tree grows), then one ``evict all`` of the whole tree;
- ``steady``: capacity = ``--capacity-fraction`` of the tokens the cold build held (LRU eviction).
Evict does the same work on both sides: SGLang's ``evict`` pops its leaves, hands each node's slot
tensor to the allocator's ``free_segment`` (a no-op here) and drops the node; tierkv's
``EvictionHeap.evict_device`` (the compiled loop when built) returns the evicted nodes' slot tensors and
the side hands each to the same no-op ``free_segment``; both release the nodes and tensors in the timed
op (tierkv's loop releases each node as it unlinks it, ``keep_nodes=False``: the side keeps none). Each op (match, insert, evict) is timed on its own in CPU time (``time.thread_time``); after one
untimed pass each, a repeat runs both trees back to back, repeats alternate which goes first, and each
ratio (SGLang time / tierkv time, above 1: tierkv faster) is reported as min and median over the
repeats. A full collection of Python's cyclic GC (both trees are cyclic) lands in whichever op runs
then and drags one repeat's ratio: the objects that exist before the timed repeats (SGLang's and torch's
imports, the workload) are frozen out of it (``gc.freeze``), and ``--no-gc`` turns the collector off. Workloads:
- ``trace``: the first N prompts of conversation_trace.jsonl (12k tokens on average), page size 16;
- ``chat``: short multi-turn keys (64-1024 tokens, shared system prompts), page size 1.

SGLang needs its own environment; `bash scripts/setup_sglang_venv.sh` builds it (.venv-sglang, sharing
tierkv's torch; a torchvision stand-in is written to a temp dir when ``torchvision`` is missing). Run:
    PYTHONPATH=. .venv-sglang/bin/python bench/bench_tree_vs_sglang.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
from array import array
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierkv.eviction import get_policy
from tierkv.pools.allocator import plain_slot_slices
from tierkv.eviction.heap import EvictionHeap
from tierkv.radix import RadixKey, RadixTree
from tierkv.replay.trace import load_trace

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
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

    return radix_cache, InsertParams, MatchPrefixParams, EvictParams


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


OPS = ("match", "insert", "evict")


class _Timer:
    """Seconds of thread CPU time per op."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(OPS + ("evict all",), 0.0)


class TierkvSide:
    name = "tierkv"

    def __init__(self, page_size: int) -> None:
        self.tree = RadixTree(page_size)
        self.heap = EvictionHeap(self.tree, "device", get_policy("lru"))
        self.allocator = _NoAllocator()

    def key(self, ids: array):
        return RadixKey(ids)

    def match(self, key) -> int:
        return self.tree.match(key).num_tokens

    def insert(self, key, value) -> None:
        with plain_slot_slices():  # as HiRadixCache.insert: the nodes' slices are no autograd views
            self.tree.insert(key, value)

    def size(self) -> int:
        return self.tree.evictable_size + self.tree.protected_size

    def evict(self, num_tokens: int) -> None:
        _, _, values = self.heap.evict_device(num_tokens, keep_nodes=False)
        free = self.allocator.free_segment
        for value in values:  # as SGLang's evict does: each node's slots back to the allocator
            free(value)


class _NoAllocator:
    """What SGLang's simulated cache needs of an allocator to evict: a device and a free that frees."""

    device = "cpu"

    def free_segment(self, indices, start_pos: int = 0) -> None:
        pass


class SglangSide:
    name = "sglang"

    def __init__(self, page_size: int, sgl) -> None:
        self.radix_cache, self.InsertParams, self.MatchPrefixParams, self.EvictParams = sgl
        self.cache = self.radix_cache.RadixCache.create_simulated(page_size=page_size,
                                                                  mock_allocator=_NoAllocator())

    def key(self, ids: array):
        return self.radix_cache.RadixKey(ids)

    def match(self, key) -> int:
        return self.cache.match_prefix(self.MatchPrefixParams(key=key)).device_prefix_len

    def insert(self, key, value) -> None:
        self.cache.insert(self.InsertParams(key=key, value=value))

    def size(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def evict(self, num_tokens: int) -> None:
        self.cache.evict(self.EvictParams(num_tokens=num_tokens))


def run(side, seqs: list[array], values: list[torch.Tensor], page_size: int, capacity: int | None) -> dict:
    """One pass of the sequence through ``side``; seconds per op."""
    clock, timer = time.thread_time, _Timer()
    spent = timer.seconds
    for ids, value in zip(seqs, values):
        t0 = clock()
        key = side.key(ids)
        hit = side.match(key)
        t1 = clock()
        spent["match"] += t1 - t0
        if capacity is not None:
            need = side.size() + len(ids) // page_size * page_size - hit - capacity
            if need > 0:
                side.evict(need)
            t2 = clock()
            spent["evict"] += t2 - t1
            t1 = t2
        side.insert(key, value)
        spent["insert"] += clock() - t1
    if capacity is None:
        t0 = clock()
        side.evict(side.size())
        spent["evict all"] += clock() - t0
    return spent


def compare(sides, seqs: list[list[int]], page_size: int, capacity: int | None, repeats: int) -> dict:
    """Per op: the SGLang / tierkv time ratio of each repeat (the two run back to back, order alternating)."""
    arrays = [array("q", s) for s in seqs]
    values = [torch.arange(len(s), dtype=torch.int64) for s in seqs]
    ratios: dict[str, list[float]] = {}
    for make in sides:  # one untimed pass each: the first pays for fresh memory (page faults), not the tree
        run(make(), arrays, values, page_size, capacity)
    gc.collect()
    gc.freeze()  # the imports' and the workload's objects: a full collection scans only what the trees made
    for r in range(repeats):
        times = {}
        for make in (sides if r % 2 == 0 else sides[::-1]):
            side = make()
            times[side.name] = run(side, arrays, values, page_size, capacity)
        for op, tk in times["tierkv"].items():
            if tk > 0:
                ratios.setdefault(op, []).append((times["sglang"][op] / tk, times["sglang"][op], tk))
    gc.unfreeze()
    return ratios


def cold_size(seqs: list[list[int]], page_size: int) -> int:
    side = TierkvSide(page_size)
    for s in seqs:
        side.insert(side.key(array("q", s)), range(len(s)))
    return side.size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--trace-requests", type=int, default=400)
    parser.add_argument("--chat-requests", type=int, default=8000)
    parser.add_argument("--capacity-fraction", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", default="trace,chat", help="comma-separated: trace, chat")
    parser.add_argument("--no-gc", action="store_true", help="cyclic GC off while timing")
    args = parser.parse_args()
    if args.no_gc:
        gc.disable()
    torch.set_num_threads(1)
    sgl = import_sglang()
    import sglang

    print(f"tierkv RadixTree ({tree_impl()}) vs SGLang {sglang.__version__} RadixCache, array('q') keys, "
          f"CPU time, {args.repeats} interleaved repeats, GC {'off' if args.no_gc else 'on'}; "
          "ratio = SGLang time / tierkv time")
    print(f"{'workload':<10} {'phase':<7} {'op':<10} {'sglang s':>9} {'tierkv s':>9} {'ratio min':>10} {'median':>7}")
    workloads = {"trace": lambda: ("trace p16", trace_workload(args.trace, args.trace_requests), 16),
                 "chat": lambda: ("chat p1", chat_workload(args.chat_requests), 1)}
    for name, seqs, page in (workloads[w]() for w in args.workloads.split(",")):
        sides = [lambda: TierkvSide(page), lambda: SglangSide(page, sgl)]
        capacity = int(cold_size(seqs, page) * args.capacity_fraction)
        for phase, cap in (("cold", None), ("steady", capacity)):
            for op, runs in compare(sides, seqs, page, cap, args.repeats).items():
                rs = [r[0] for r in runs]
                print(f"{name:<10} {phase:<7} {op:<10} {statistics.median(r[1] for r in runs):>9.3f} "
                      f"{statistics.median(r[2] for r in runs):>9.3f} {min(rs):>9.2f}x {statistics.median(rs):>6.2f}x")


def tree_impl() -> str:
    import tierkv.radix as radix

    from tierkv.eviction import heap

    evict = "C" if heap.native_evict_device is not None else "Python"
    return f"{radix.implementation()} key comparison, {evict} eviction loop"


if __name__ == "__main__":
    main()
