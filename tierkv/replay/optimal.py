"""Offline-optimal bound: Belady's MIN over the page-level prefix workload of a trace.

The workload is exactly what the radix cache sees. Request ``r``'s prompt is cut to its whole pages of
``page_size`` tokens; page ``k`` is identified by the whole token prefix it ends (so two pages are the same
page only when the prompts agree up to its last token). A request *hits* the longest run of its leading
pages that are cached; after the request all of its pages are offered to the cache.

Policy (MIN with bypass): after each request, every page of the request is inserted, then while more
than ``capacity_tokens // page_size`` pages are cached the cache drops the page whose next use (the index
of the next request containing it) is farthest in the future, never-used-again pages first; ties go to
the deeper page (larger token position), then to the smaller internal id. Dropping a just-inserted page
is allowed (that is the bypass). Because a page is used whenever any page below it is used, a page's next
use is never later than its descendants', so the chosen page is always a leaf: the cache stays
prefix-closed and every cached page of a request lies in its hit run. For uniform page sizes MIN with
bypass minimises misses over every policy that may only cache pages already seen, so its hit tokens bound
any online prefix cache of the same capacity replaying the same trace.

Computation: pages of one block that are always used together form a *segment*, handled as one heap
entry with a resident page count (its pages share next uses and are dropped tail first, which is the
deeper-first tie-break). This makes the bound take well under a second per 10k requests.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tierkv.replay.trace import BLOCK_TOKENS, TraceRequest

_NEVER = 1 << 62


@dataclass
class OptimalResult:
    """Hit tokens of MIN per request, and in total. ``capacity_tokens`` None means unbounded."""

    capacity_tokens: int | None
    page_size: int
    prompt_tokens: int
    hit_tokens: int
    per_request_hit_tokens: list[int]

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _pages_per_block(input_length: int, num_blocks: int, page_size: int) -> list[int]:
    """Whole pages of the prompt whose last token falls in each 512-token block."""
    whole = input_length // page_size
    return [min((i + 1) * BLOCK_TOKENS // page_size, whole) - min(i * BLOCK_TOKENS // page_size, whole)
            for i in range(num_blocks)]


class _Workload:
    """Requests as lists of segment ids, with segment sizes (pages), depths and next uses."""

    def __init__(self, requests: list[TraceRequest], page_size: int) -> None:
        node_ids: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node: a trie of prefixes
        occurrences: list[list[tuple[int, int]]] = []  # per request: (node, pages used of it)
        node_depth: list[int] = []
        counts: list[set[int]] = []
        for req in requests:
            parent, used = -1, []
            for pos, (block_id, num_pages) in enumerate(
                    zip(req.hash_ids, _pages_per_block(req.input_length, len(req.hash_ids), page_size))):
                node = node_ids.setdefault((parent, block_id), len(node_ids))
                if node == len(node_depth):
                    node_depth.append(pos)
                    counts.append(set())
                if num_pages:
                    counts[node].add(num_pages)
                    used.append((node, num_pages))
                parent = node
            occurrences.append(used)
        self.size: list[int] = []
        self.depth: list[int] = []
        first_segment: dict[int, dict[int, list[int]]] = {}  # node -> pages used -> its segments
        for node, distinct in enumerate(counts):
            lo, chain = 0, []
            by_count = {}
            for hi in sorted(distinct):
                chain.append(len(self.size))
                self.size.append(hi - lo)
                self.depth.append(node_depth[node] * (BLOCK_TOKENS + 1) + lo)
                by_count[hi] = list(chain)
                lo = hi
            first_segment[node] = by_count
        self.requests: list[list[int]] = [
            [s for node, n in used for s in first_segment[node][n]] for used in occurrences]
        self.next_use: list[list[int]] = self._next_uses()

    def _next_uses(self) -> list[list[int]]:
        following: dict[int, int] = {}
        out: list[list[int]] = [[] for _ in self.requests]
        for r in range(len(self.requests) - 1, -1, -1):
            segs = self.requests[r]
            out[r] = [following.get(s, _NEVER) for s in segs]
            for s in segs:
                following[s] = r
        return out


def belady_min(requests: list[TraceRequest], capacity_tokens: int | None, page_size: int) -> OptimalResult:
    """MIN's hit tokens (see the module docstring) at ``capacity_tokens`` (None: never evict)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if capacity_tokens is not None and (not isinstance(capacity_tokens, int) or capacity_tokens < 0):
        raise ValueError(f"capacity_tokens must be an int >= 0 or None, got {capacity_tokens!r}")
    work = _Workload(requests, page_size)
    capacity = _NEVER if capacity_tokens is None else capacity_tokens // page_size
    resident = [0] * len(work.size)
    next_use = [_NEVER] * len(work.size)
    heap: list[tuple[int, int, int]] = []
    used, per_request = 0, []
    for segs, nexts in zip(work.requests, work.next_use):
        hit_pages = 0
        for s in segs:
            hit_pages += resident[s]
            if resident[s] < work.size[s]:
                break
        per_request.append(hit_pages * page_size)
        for s, nxt in zip(segs, nexts):
            used += work.size[s] - resident[s]
            resident[s], next_use[s] = work.size[s], nxt
            heapq.heappush(heap, (-nxt, -work.depth[s], s))
        while used > capacity:
            neg_next, neg_depth, s = heapq.heappop(heap)
            if resident[s] == 0 or -neg_next != next_use[s]:
                continue  # stale entry: the segment was evicted or used again since
            drop = min(used - capacity, resident[s])
            resident[s] -= drop
            used -= drop
            if resident[s]:
                heapq.heappush(heap, (neg_next, neg_depth, s))
    prompt = sum(r.input_length for r in requests)
    return OptimalResult(capacity_tokens, page_size, prompt, sum(per_request), per_request)
