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
deeper-first tie-break). The workload (segments, next uses) is built with numpy in flat arrays, once for
any number of capacities (:func:`belady_mins`); MIN's heap holds one int per entry and is compacted when
stale entries outnumber live ones, so its memory is bounded by the capacity, and the workload's is ~16 B
per segment use of the trace.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.replay.trace import BLOCK_TOKENS, TraceRequest, TraceRequests

_NEVER = 1 << 31  # a next use past every request (traces hold fewer than 2**31)
_PAIR_SPAN = 1024  # > pages of one block (512 at page size 1): (node, pages) packed in one int
# A heap entry packs (far next use first, then deeper first, then smaller segment id) in one int:
# next use in bits 57.., depth (block position x 513 + page offset < 2**25) in 32..56, segment id in 0..31.
_DEPTH_SPAN = 1 << 25
_SEGMENT_BITS = 32
_HEAP_SLACK = 4096  # stale heap entries tolerated beyond the live ones before a compaction


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


class _Workload:
    """Requests as runs of segment ids in flat arrays (``segments[starts[r]:starts[r + 1]]`` is request
    ``r``'s, in prefix order, ``next_uses`` beside it), with each segment's size (pages) and depth.

    Built with numpy over every block occurrence at once: a per-block Python structure (a trie of dicts,
    a list per request) cost ~100 MiB per 12k requests and was most of the replay's peak RSS.
    """

    def __init__(self, requests: Sequence[TraceRequest], page_size: int) -> None:
        blocks, lengths, input_lengths = _block_columns(requests)
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        position = np.arange(len(blocks), dtype=np.int64) - np.repeat(starts[:-1], lengths)
        node = _trie_nodes(blocks, position)
        del blocks
        whole = np.repeat(input_lengths // page_size, lengths)  # whole pages of each occurrence's prompt
        pages = (np.minimum((position + 1) * BLOCK_TOKENS // page_size, whole)
                 - np.minimum(position * BLOCK_TOKENS // page_size, whole))
        del whole
        # A node used with k distinct page counts is k segments (counts ascending), each the pages
        # between one count and the next: the segments of a node are always used as a leading chain.
        used = pages > 0
        pair = node * _PAIR_SPAN + pages
        pairs = np.unique(pair[used])
        pair_node = pairs // _PAIR_SPAN
        first_of_node = np.ones(len(pairs), dtype=bool)
        first_of_node[1:] = pair_node[1:] != pair_node[:-1]
        lo = np.where(first_of_node, 0, np.roll(pairs % _PAIR_SPAN, 1))
        self.size = _as_array(pairs % _PAIR_SPAN - lo)
        node_depth = np.zeros(int(node.max(initial=-1)) + 1, dtype=np.int64)
        node_depth[node] = position
        self.depth = _as_array(node_depth[pair_node] * (BLOCK_TOKENS + 1) + lo)
        del node_depth, lo, position
        # each used occurrence is the chain from its node's first segment to its own count's
        last = np.searchsorted(pairs, pair[used])
        first = np.searchsorted(pairs, node[used] * _PAIR_SPAN)
        del pair, node, pairs, pair_node, first_of_node
        per_occurrence = last - first + 1
        segments = np.repeat(first, per_occurrence) + _ramps(per_occurrence)
        del first, last
        used_before = np.zeros(len(used) + 1, dtype=np.int64)
        np.cumsum(used, out=used_before[1:])
        seg_before = np.zeros(len(per_occurrence) + 1, dtype=np.int64)
        np.cumsum(per_occurrence, out=seg_before[1:])
        self.starts = seg_before[used_before[starts]].tolist()
        del seg_before, used_before, per_occurrence
        self.next_uses = _as_array(_next_uses(segments, np.asarray(self.starts, dtype=np.int64)))
        self.segments = _as_array(segments)  # array('q'): MIN's loop reads it item by item


def _block_columns(requests: Sequence[TraceRequest]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every request's block ids end to end, each request's block count, and its prompt length."""
    if isinstance(requests, TraceRequests):
        return requests.block_columns()
    lengths = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=len(requests))
    blocks = np.fromiter(itertools.chain.from_iterable(r.hash_ids for r in requests), dtype=np.int64,
                         count=int(lengths.sum()))
    input_lengths = np.fromiter((r.input_length for r in requests), dtype=np.int64, count=len(requests))
    return blocks, lengths, input_lengths


def _trie_nodes(blocks: np.ndarray, position: np.ndarray) -> np.ndarray:
    """A node id per block occurrence: equal ids exactly when the block ids up to it are equal (a trie
    of prefixes, built one depth at a time: a node is its parent's node and its own block id)."""
    node = np.empty(len(blocks), dtype=np.int64)
    order = np.argsort(position, kind="stable")
    bounds = np.searchsorted(position[order], np.arange(int(position.max(initial=-1)) + 2))
    num_nodes = 0
    for depth in range(len(bounds) - 1):
        at = order[bounds[depth]:bounds[depth + 1]]
        parent = node[at - 1] + 1 if depth else np.zeros(len(at), dtype=np.int64)
        ids, inverse = np.unique(parent << 31 | blocks[at], return_inverse=True)
        node[at] = inverse.reshape(-1) + num_nodes
        num_nodes += len(ids)
    return node


def _ramps(lengths: np.ndarray) -> np.ndarray:
    """0, 1, .., n - 1 for each n of ``lengths``, end to end."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) - np.repeat(ends - lengths, lengths)


def _next_uses(segments: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """For each use of a segment, the index of the next request using it (_NEVER when none does)."""
    request = np.repeat(np.arange(len(starts) - 1, dtype=np.int64), np.diff(starts))
    order = np.lexsort((request, segments))
    following = np.full(len(segments), _NEVER, dtype=np.int64)
    same = segments[order[1:]] == segments[order[:-1]]
    following[order[:-1][same]] = request[order[1:][same]]
    return following


def belady_min(requests: Sequence[TraceRequest], capacity_tokens: int | None, page_size: int) -> OptimalResult:
    """MIN's hit tokens (see the module docstring) at ``capacity_tokens`` (None: never evict)."""
    return belady_mins(requests, [capacity_tokens], page_size)[0]


def belady_mins(requests: Sequence[TraceRequest], capacities_tokens: Sequence[int | None],
                page_size: int) -> list[OptimalResult]:
    """:func:`belady_min` at each of ``capacities_tokens``, building the workload once."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    for capacity in capacities_tokens:
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"capacity_tokens must be an int >= 0 or None, got {capacity!r}")
    work = _Workload(requests, page_size)
    prompt = requests.prompt_tokens if isinstance(requests, TraceRequests) else sum(r.input_length for r in requests)
    results = []
    for capacity in capacities_tokens:
        per_request = _run_min(work, None if capacity is None else capacity // page_size, page_size)
        results.append(OptimalResult(capacity, page_size, prompt, sum(per_request), per_request))
    return results


def _run_min(work: _Workload, capacity_pages: int | None, page_size: int) -> list[int]:
    """Hit tokens per request of MIN with ``capacity_pages`` (None: unbounded, nothing is dropped)."""
    size, depth = work.size, work.depth
    resident = array("q", bytes(8 * len(size)))
    next_use = array("q", [_NEVER]) * len(size)
    segments, next_uses, starts = work.segments, work.next_uses, work.starts
    heap: list[int] = []
    heap_limit = _HEAP_SLACK
    used, per_request = 0, []
    for r in range(len(starts) - 1):
        segs, nexts = segments[starts[r]:starts[r + 1]], next_uses[starts[r]:starts[r + 1]]
        hit_pages = 0
        for s in segs:
            hit_pages += resident[s]
            if resident[s] < size[s]:
                break
        per_request.append(hit_pages * page_size)
        for s, nxt in zip(segs, nexts):
            used += size[s] - resident[s]
            resident[s], next_use[s] = size[s], nxt
            if capacity_pages is not None:
                heapq.heappush(heap, (_NEVER - nxt) << 57 | (_DEPTH_SPAN - 1 - depth[s]) << _SEGMENT_BITS | s)
        if capacity_pages is None or used <= capacity_pages:
            continue
        used = _drop_farthest(heap, used, capacity_pages, resident, next_use)
        if len(heap) > heap_limit:  # stale entries (segments used again or dropped since) pile up
            heap[:] = [k for k in heap if _is_live(k, resident, next_use)]
            heapq.heapify(heap)
            heap_limit = 2 * len(heap) + _HEAP_SLACK
    return per_request


def _is_live(key: int, resident: array, next_use: array) -> bool:
    s = key & ((1 << _SEGMENT_BITS) - 1)
    return resident[s] > 0 and _NEVER - (key >> 57) == next_use[s]


def _drop_farthest(heap: list[int], used: int, capacity_pages: int, resident: array, next_use: array) -> int:
    """Drop pages, farthest next use first, until ``used`` fits ``capacity_pages``; the pages now used."""
    while used > capacity_pages:
        key = heapq.heappop(heap)
        if not _is_live(key, resident, next_use):
            continue  # stale entry: the segment was evicted or used again since
        s = key & ((1 << _SEGMENT_BITS) - 1)
        drop = min(used - capacity_pages, resident[s])
        resident[s] -= drop
        used -= drop
        if resident[s]:
            heapq.heappush(heap, key)
    return used


def _as_array(values: np.ndarray) -> array:
    """An int64 numpy array as an ``array('q')``: its items index as Python ints, ~3x faster than numpy's."""
    out = array("q")
    out.frombytes(memoryview(np.ascontiguousarray(values, dtype=np.int64)).cast("B"))  # no bytes copy
    return out
