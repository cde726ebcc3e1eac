"""The baseline of bench_replay.py: a minimal page-level LRU over integer page ids.

What the replay would cost if a cache were nothing but a dict: each prompt page (``page_size`` tokens,
whole pages only, as the cache cuts keys) gets an integer id chained from its parent's, so equal ids mean
equal prefixes; one ``OrderedDict`` of the cache's total capacity (L1 + L2) in pages holds them in LRU
order. A request hits its leading run of cached pages, then touches all its pages deepest first (so a
parent is more recent than its children and the LRU drops leaves first, like a radix-tree LRU). No tree,
no tiers, no slots, no KV bytes: a lower bound on the work of a replay, not a cache model.

Page ids come straight from the trace's block ids: in a Mooncake trace a block id names the block and its
whole prefix, so page ``j`` is named by the id of the block holding its last token and ``j`` itself.

Run alone:  python bench/page_lru_sim.py data/traces/conversation_trace.jsonl.gz --total-tokens 4.5M
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.replay.trace import BLOCK_TOKENS, TraceRequest, load_trace  # noqa: E402


def page_ids(req: TraceRequest, page_size: int) -> list[int]:
    """Chained integer ids of the request's whole prompt pages: ``id_j = hash((id_{j-1}, block, j))``."""
    ids, prev = [], 0
    blocks = req.hash_ids
    for j in range(req.input_length // page_size):
        prev = hash((prev, blocks[(j * page_size + page_size - 1) // BLOCK_TOKENS], j))
        ids.append(prev)
    return ids


class PageLRU:
    """An LRU set of page ids with room for ``capacity_pages``; :meth:`serve` returns hit pages."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = capacity_pages
        self.pages: OrderedDict[int, None] = OrderedDict()

    def serve(self, ids: list[int]) -> int:
        pages = self.pages
        hit = 0
        for page in ids:
            if page not in pages:
                break
            hit += 1
        for page in reversed(ids):
            if page in pages:
                pages.move_to_end(page)
            else:
                pages[page] = None
        while len(pages) > self.capacity_pages:
            pages.popitem(last=False)
        return hit


def simulate(requests: list[TraceRequest], total_tokens: int, page_size: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of the trace through one :class:`PageLRU` of ``total_tokens``."""
    lru = PageLRU(total_tokens // page_size)
    hit_pages = 0
    for req in requests:
        hit_pages += lru.serve(page_ids(req, page_size))
    return hit_pages * page_size, sum(r.input_length for r in requests)


def main() -> None:
    from tierkv.replay.report import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--total-tokens", default="4.5M", help="capacity in tokens (the cache's L1 + L2)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    requests = load_trace(args.trace, limit=args.limit).requests
    cpu = time.process_time()
    hit, total = simulate(requests, parse_size(args.total_tokens), args.page_size)
    print(f"{len(requests)} requests: hit {100 * hit / total:.2f} % of {total:,} prompt tokens, "
          f"{time.process_time() - cpu:.2f} s CPU")


if __name__ == "__main__":
    main()
