"""The cache's own match / insert / evict against SGLang's RadixCache, side by side, as the product calls them.

tierkv side: ``HiRadixCache`` (L1 only, LRU, whole-node victims so both sides evict the same nodes), called as
the trace replay and the engine's scheduler call it: ``match_prefix(RadixKey(array('q')))`` (returns the
device indices), ``evict(n)`` before allocating, ``insert(key, torch.cat([prefix, new_slots]))`` with slots
the cache's own device pool allocated (the partial last page's leftover freed by the caller, untimed).
``--host`` adds the L2 tier: every inserted node is backed up (write_through, waited for), then the
device tier is evicted and ``evict_host`` times the L2 eviction of the host-only tree.
SGLang side (0.5.23): ``RadixCache.create_simulated`` fed the same ``array('q')`` keys; its match also reads
the prefix's indices (``path_device_indices``, what its scheduler's ``prefix_device_indices`` does), its
insert gets a value tensor per request as its scheduler's ``req_to_token`` copy gives it, its evict frees
each leaf's slots into the allocator its scheduler builds (``TokenToKVPoolAllocator`` at page 1,
``PagedTokenToKVPoolAllocator`` above; ``need_sort`` False as it runs, ``--sglang-need-sort`` for its
disaggregated setting), which the benchmark also allocates from. Both pools hold the same number of slots
(``pool_slots``: what the tree holds at most plus the longest request).

Equal work is checked every repeat (see ``check_work``): without eviction the hit of every match and the
tree's size after every insert agree on both sides; with eviction the tokens matched, evicted and inserted
agree within 5%, or the run stops. Phases: ``cold`` (no capacity limit,
then one ``evict all``) and ``steady`` (capacity = ``--capacity-fraction`` of the cold tree; evict what
each request needs beyond it). CPU time of this thread per op (``time.thread_time``); after an untimed
pass each, repeats alternate which side goes first; ratio = SGLang time / tierkv time (above 1: tierkv
faster), min and median over the repeats. Objects that exist before the timed repeats are frozen out of
the cyclic collector (``gc.freeze``). Shapes:
- ``trace``: the first N prompts of the shipped conversation trace, page 16;
- ``chat``: short multi-turn keys (64-1024 tokens) under 8 system prompts, page 1;
- ``agent``: tool prompts of 3-6k tokens, sessions of tool-call steps and deep forks from earlier steps, page 16;
- ``fanout``: 3 long system prompts (2-4k tokens), thousands of short branches and follow-ups, page 1.

``--memory`` measures, per shape and side in a fresh process, RSS growth per cached token after a cold
build (each request's arrays and slot tensors dropped once inserted, as a scheduler drops them).

SGLang needs its own environment: `bash scripts/setup_sglang_venv.sh` (``TIERKV_SGLANG_VENV`` sets where).
    PYTHONPATH=. .venv-sglang/bin/python bench/bench_tree_vs_sglang.py [--repeats 5] [--memory] [--host]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool, HostKVPool, KVSpec
from tierkv.radix import RadixKey
from tierkv.replay.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl.gz"  # shipped with the repository
SPEC = KVSpec(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.uint8)  # the pool's bytes are not the subject

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
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )

    return radix_cache, InsertParams, MatchPrefixParams, EvictParams


def trace_workload(n: int, path: str = str(TRACE)) -> list[list[int]]:
    return [r.prompt_tokens() for r in load_trace(path, limit=n).requests]


def _tokens(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(rng.randrange(lo, hi))]


def chat_workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [_tokens(rng, 64, 256) for _ in range(8)]
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.7:
            conv = rng.choice(convs)
            conv.extend(_tokens(rng, 16, 128))
            if len(conv) > 1024:
                convs.remove(conv)
        else:
            conv = list(rng.choice(systems)) + _tokens(rng, 16, 128)
            convs.append(conv)
        out.append(list(conv))
    return out


def agent_workload(n: int, seed: int = 1) -> list[list[int]]:
    """Agent sessions: a tool prompt (3-6k tokens) and a task, then tool-call steps (50-400 tokens each);
    a quarter of the requests fork a session at an earlier step (a retry, a sub-agent) and go on from there."""
    rng = random.Random(seed)
    tools = [_tokens(rng, 3000, 6000) for _ in range(6)]
    sessions: list[list[int]] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if sessions and r < 0.6:
            s = rng.choice(sessions)
            s.extend(_tokens(rng, 50, 400))
            if len(s) > 16000:
                sessions.remove(s)
        elif sessions and r < 0.85:
            base = rng.choice(sessions)
            s = base[:rng.randrange(len(base) // 2, len(base))] + _tokens(rng, 50, 400)
            sessions.append(s)
        else:
            s = list(rng.choice(tools)) + _tokens(rng, 100, 300)
            sessions.append(s)
        out.append(list(s))
    return out


def fanout_workload(n: int, seed: int = 2) -> list[list[int]]:
    """3 long system prompts (2-4k tokens) under thousands of short branches (10-60 tokens); a fifth of
    the requests follow a branch up (10-60 tokens more)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, 2000, 4000) for _ in range(3)]
    branches: list[list[int]] = []
    out = []
    for _ in range(n):
        if branches and rng.random() < 0.2:
            b = rng.choice(branches)
            b.extend(_tokens(rng, 10, 60))
        else:
            b = list(rng.choice(systems)) + _tokens(rng, 10, 60)
            branches.append(b)
        out.append(list(b))
    return out


SHAPES = {"trace": (trace_workload, 16, 400), "chat": (chat_workload, 1, 8000),
          "agent": (agent_workload, 16, 600), "fanout": (fanout_workload, 1, 6000)}
OPS = ("match", "insert", "evict", "evict all", "evict_host")


class TierkvSide:
    """HiRadixCache as the replay and the scheduler call it; L1 holds ``num_slots``."""

    name = "tierkv"

    def __init__(self, page_size: int, num_slots: int, host: bool = False) -> None:
        self.page_size = page_size
        self.pool = DeviceKVPool(SPEC, num_slots, page_size, "cpu")
        config = CacheConfig(page_size=page_size, eviction_policy="lru", split_victims=False,
                             enable_host=host, overlap_cpu_writes=False, cost_aware=False)
        host_pool = HostKVPool(SPEC, num_slots, page_size, "page_first") if host else None
        self.cache = HiRadixCache(self.pool, config, host_pool=host_pool)

    def key(self, ids: array):
        return RadixKey(ids)

    def match(self, key):
        match = self.cache.match_prefix(key)
        return len(match.device_indices), match.device_indices

    def slots(self, num_tokens: int, prefix: torch.Tensor) -> torch.Tensor:
        """What the caller inserts: the matched prefix's slots, then new ones for the rest (untimed)."""
        num_new = num_tokens - len(prefix)
        num_alloc = -(-num_new // self.page_size) * self.page_size
        new = self.pool.alloc(num_alloc) if num_alloc else prefix[:0]
        if new is None:
            raise RuntimeError("the benchmark's L1 pool is too small")
        return torch.cat([prefix, new])

    def insert(self, key, slots: torch.Tensor) -> int:
        return self.cache.insert(key, slots)

    def release(self, slots: torch.Tensor, owned: int) -> None:
        """The caller frees what the tree did not take (a partial last page)."""
        if owned < len(slots):
            self.pool.free(slots[owned:])

    def size(self) -> int:
        return self.cache.evictable_size + self.cache.protected_size

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens)

    def backup_all(self) -> None:
        """Every node to L2 (untimed), then L1 emptied: the tree is host-only for ``evict_host``."""
        for node in list(self.cache.tree.nodes()):
            if node.host_value is None and node.device_value is not None:
                self.cache.write_backup(node)
        self.cache.flush()
        self.cache.evict(self.size())

    def evict_host(self, num_tokens: int) -> int:
        return self.cache.evict_host(num_tokens)

    def host_size(self) -> int:
        return sum(len(n.host_value) for n in self.cache.tree.nodes() if n.host_value is not None)


def sglang_allocator(page_size: int, num_slots: int, need_sort: bool):
    """The slot allocator SGLang's scheduler gives its RadixCache (kv_cache_configurator: page 1 takes
    ``TokenToKVPoolAllocator``, a larger page ``PagedTokenToKVPoolAllocator``; ``need_sort`` False but for
    disaggregated prefill/decode). Its alloc and free never touch the KV pool, so none is made."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if page_size == 1:
        return TokenToKVPoolAllocator(num_slots, torch.int64, "cpu", kvcache=None, need_sort=need_sort)
    return PagedTokenToKVPoolAllocator(num_slots, page_size, torch.int64, "cpu", kvcache=None, need_sort=need_sort)


class SglangSide:
    """SGLang's RadixCache on its real allocator: its evict frees each victim's slots into the free list."""

    name = "sglang"

    def __init__(self, page_size: int, sgl, num_slots: int, need_sort: bool = False) -> None:
        self.radix_cache, self.InsertParams, self.MatchPrefixParams, self.EvictParams = sgl
        self.page_size = page_size
        self.allocator = sglang_allocator(page_size, num_slots, need_sort)
        self.cache = self.radix_cache.RadixCache.create_simulated(page_size=page_size,
                                                                  mock_allocator=self.allocator)

    def key(self, ids: array):
        return self.radix_cache.RadixKey(ids)

    def match(self, key):
        result = self.cache.match_prefix(self.MatchPrefixParams(key=key))
        hit = result.device_prefix_len
        return hit, self.cache.path_device_indices(result.last_device_node)[:hit]

    def slots(self, num_tokens: int, prefix: torch.Tensor) -> torch.Tensor:
        """The matched prefix's slots, then whole pages from the allocator for the rest (untimed)."""
        num_new = num_tokens - len(prefix)
        new = self.allocator.alloc(-(-num_new // self.page_size) * self.page_size) if num_new else prefix[:0]
        if new is None:
            raise RuntimeError("the benchmark's SGLang pool is too small")
        return torch.cat([prefix, new[:num_new]])

    def insert(self, key, slots: torch.Tensor) -> int:
        """The tree takes the key's whole pages (its insert cuts the rest); the prefix was its own."""
        self.cache.insert(self.InsertParams(key=key, value=slots))
        return len(slots) // self.page_size * self.page_size

    def release(self, slots: torch.Tensor, owned: int) -> None:
        """The caller frees the partial last page, as SGLang's cache_finished_req does."""
        if owned < len(slots):
            self.allocator.free(slots[owned:])

    def size(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(self.EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def backup_all(self) -> None:
        pass

    def evict_host(self, num_tokens: int) -> int:
        """SGLang's RadixCache has no L2: its L1 eviction of the same tree is the baseline."""
        return self.evict(num_tokens)

    def host_size(self) -> int:
        return self.size()


def run(side, seqs: list[list[int]], page_size: int, capacity: int | None, host: bool) -> tuple[dict, list]:
    """One pass of the sequence through ``side``: seconds per op, and the work done (checked equal)."""
    clock = time.thread_time
    spent, work = dict.fromkeys(OPS, 0.0), []
    for tokens in seqs:
        ids = array("q", tokens)
        t0 = clock()
        key = side.key(ids)
        hit, prefix = side.match(key)
        spent["match"] += clock() - t0
        work.append(hit)
        if capacity is not None:
            need = side.size() + len(ids) // page_size * page_size - hit - capacity
            if need > 0:
                t0 = clock()
                freed = side.evict(need)
                spent["evict"] += clock() - t0
                work.append(-freed)
        slots = side.slots(len(ids), prefix)
        t0 = clock()
        owned = side.insert(key, slots)
        spent["insert"] += clock() - t0
        side.release(slots, owned)
        work.append(side.size())
    if capacity is None and host:
        side.backup_all()
        size = side.host_size()
        t0 = clock()
        work.append(side.evict_host(size))
        spent["evict_host"] += clock() - t0
    elif capacity is None:
        size = side.size()
        t0 = clock()
        work.append(side.evict(size))
        spent["evict all"] += clock() - t0
    return spent, work


def compare(makers, seqs: list[list[int]], page_size: int, capacity: int | None, repeats: int,
            host: bool) -> dict:
    """Per op: (ratio, sglang s, tierkv s) of each repeat, the two run back to back, order alternating."""
    for make in makers:  # one untimed pass each: the first pays for fresh memory (page faults), not the tree
        run(make(), seqs, page_size, capacity, host)
    gc.collect()
    gc.freeze()  # the imports' and the workload's objects: a full collection scans only what the trees made
    ratios: dict[str, list[tuple[float, float, float]]] = {}
    try:
        for r in range(repeats):
            times, works = {}, {}
            for make in (makers if r % 2 == 0 else makers[::-1]):
                side = make()
                times[side.name], works[side.name] = run(side, seqs, page_size, capacity, host)
                del side
                gc.collect()
            check_work(works["tierkv"], works["sglang"], exact=capacity is None)
            for op, tk in times["tierkv"].items():
                if tk > 0:
                    ratios.setdefault(op, []).append((times["sglang"][op] / tk, times["sglang"][op], tk))
    finally:
        gc.unfreeze()
    return ratios


def check_work(tierkv: list[int], sglang: list[int], exact: bool) -> None:
    """Raise unless both sides did the same work. Without eviction, step by step: every match's hit,
    every tree size. With eviction, the totals (tokens matched, evicted, inserted) within 5%: the two
    LRUs differ on one point (SGLang's partial match also touches the unmatched tail of the node it
    splits, tierkv's leaves it as old as it was), so once a tie like that is broken differently the
    victims, and the hits after them, may differ a little."""
    if exact:
        if tierkv != sglang:
            at = next(i for i, (a, b) in enumerate(zip(tierkv, sglang)) if a != b)
            raise AssertionError(f"unequal work at step {at}: tierkv {tierkv[at]}, sglang {sglang[at]}")
        return
    for name, pick in (("evicted", lambda w: -sum(x for x in w if x < 0)),
                       ("matched and inserted", lambda w: sum(x for x in w if x > 0))):
        a, b = pick(tierkv), pick(sglang)
        if abs(a - b) > 0.05 * max(a, b, 1):
            raise AssertionError(f"unequal work: tierkv {name} {a} tokens, sglang {b}")


def cold_size(seqs: list[list[int]], page_size: int) -> int:
    total = sum(len(s) for s in seqs) + 64
    side = TierkvSide(page_size, total // page_size * page_size + page_size)
    for s in seqs:
        key = side.key(array("q", s))
        _, prefix = side.match(key)
        slots = side.slots(len(s), prefix)
        side.release(slots, side.insert(key, slots))
    return side.size()


def pool_slots(seqs: list[list[int]], page_size: int, held_tokens: int) -> int:
    """Slots of each side's L1 pool: what the tree holds at most (the cold tree, or the steady capacity) plus
    the longest request and a page of slack. Both sides get the same; sized as a scheduler sizes it (what
    the memory holds), since SGLang's free list is concatenated on every free and grows with the pool."""
    longest = max(len(s) for s in seqs)
    return -(-(held_tokens + longest) // page_size) * page_size + 2 * page_size


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(shape: str, side_name: str, requests: int) -> None:
    """Print RSS growth per cached token of one side's cold build (run in a fresh process)."""
    make_seqs, page, _ = SHAPES[shape]
    seqs = make_seqs(requests)
    if side_name == "tierkv":
        side = TierkvSide(page, sum(len(s) for s in seqs) // page * page + 2 * page)
    else:
        side = SglangSide(page, import_sglang(), sum(len(s) for s in seqs) // page * page + 2 * page)
    torch.empty(1)  # the allocator's first use
    gc.collect()
    before = rss_bytes()
    for s in seqs:
        key = side.key(array("q", s))
        _, prefix = side.match(key)
        slots = side.slots(len(s), prefix)
        side.release(slots, side.insert(key, slots))
        del key, prefix, slots  # the caller's arrays: dropped once inserted
    gc.collect()
    print((rss_bytes() - before) / side.size(), side.size())


def memory_table(shapes: list[str], sizes: dict[str, int]) -> None:
    print("\nRSS growth per cached token, cold build, fresh process per side (bytes; lower is better)")
    print(f"{'shape':<8} {'tokens':>9} {'sglang B':>9} {'tierkv B':>9} {'ratio':>6}")
    for shape in shapes:
        per = {}
        for name in ("sglang", "tierkv"):
            out = subprocess.run([sys.executable, __file__, "--memory-child", shape, name,
                                  "--requests", str(sizes[shape])], capture_output=True, text=True, check=True)
            per[name], tokens = out.stdout.split()[-2:]
        s, t = float(per["sglang"]), float(per["tierkv"])
        print(f"{shape:<8} {int(tokens):>9} {s:>9.1f} {t:>9.1f} {t / s:>5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="trace,chat,agent,fanout", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--requests", type=int, default=None, help="per shape (default: its own)")
    parser.add_argument("--capacity-fraction", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host", action="store_true", help="also time evict_host on a host-only tree")
    parser.add_argument("--memory", action="store_true", help="also measure RSS per cached token")
    parser.add_argument("--sglang-need-sort", action="store_true",
                        help="SGLang's allocator parks freed pages and sorts them when short (its disaggregated "
                             "prefill/decode setting; default off, as its scheduler runs)")
    parser.add_argument("--memory-child", nargs=2, metavar=("SHAPE", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = args.shapes.split(",")
    sizes = {s: args.requests or SHAPES[s][2] for s in SHAPES}
    if args.memory_child:
        memory_child(*args.memory_child, sizes[args.memory_child[0]])
        return
    sgl = import_sglang()
    import sglang

    print(f"tierkv HiRadixCache ({tree_impl()}) vs SGLang {sglang.__version__} RadixCache, array('q') keys, "
          f"thread CPU time, {args.repeats} interleaved repeats, equal work checked; "
          "ratio = SGLang time / tierkv time")
    print(f"{'shape':<10} {'phase':<7} {'op':<10} {'sglang s':>9} {'tierkv s':>9} {'ratio min':>10} {'median':>7}")
    for shape in shapes:
        make_seqs, page, _ = SHAPES[shape]
        seqs = make_seqs(sizes[shape])
        cold = cold_size(seqs, page)
        capacity = int(cold * args.capacity_fraction)
        phases = [("cold", None, False), ("steady", capacity, False)] + ([("L2", None, True)] if args.host else [])
        for phase, cap, host in phases:
            num_slots = pool_slots(seqs, page, cold if cap is None else cap)
            makers = [lambda page=page, num_slots=num_slots, host=host: TierkvSide(page, num_slots, host),
                      lambda page=page, num_slots=num_slots: SglangSide(page, sgl, num_slots, args.sglang_need_sort)]
            for op, runs in compare(makers, seqs, page, cap, args.repeats, host).items():
                if host and op != "evict_host":
                    continue  # the same ops as "cold", plus the L2 backups
                rs = [r[0] for r in runs]
                print(f"{shape + ' p' + str(page):<10} {phase:<7} {op:<10} "
                      f"{statistics.median(r[1] for r in runs):>9.3f} {statistics.median(r[2] for r in runs):>9.3f} "
                      f"{min(rs):>9.2f}x {statistics.median(rs):>6.2f}x", flush=True)
    if args.memory:
        memory_table(shapes, sizes)


def tree_impl() -> str:
    from tierkv import radix
    from tierkv.eviction import heap

    evict = "C" if heap.native_evict_device is not None else "Python"
    return f"{radix.implementation()} key comparison, {evict} eviction loop"


if __name__ == "__main__":
    main()
