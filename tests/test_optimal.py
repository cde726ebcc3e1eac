import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.replay import optimal
from tierkv.replay.optimal import belady_min, belady_mins
from tierkv.replay.trace import TraceRequest, load_trace

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_200.jsonl"


def request(index, hash_ids, input_length=None):
    length = input_length or 512 * len(hash_ids)
    return TraceRequest(index, index + 1, 0, length, 0, tuple(hash_ids))


def page_keys(req, page_size):
    tokens = req.prompt_tokens()
    return [hash(tuple(tokens[: (k + 1) * page_size])) for k in range(len(tokens) // page_size)]


def brute_force_best(requests, capacity_pages, page_size):
    """Exhaustive search over every cache content (any subset, not only prefix-closed) after each request."""
    states = {frozenset(): 0}
    for req in requests:
        keys = page_keys(req, page_size)
        nxt = {}
        for cached, hits in states.items():
            run = next((i for i, k in enumerate(keys) if k not in cached), len(keys))
            universe = sorted(cached | set(keys))
            for size in range(min(capacity_pages, len(universe)) + 1):
                for keep in itertools.combinations(universe, size):
                    keep = frozenset(keep)
                    if nxt.get(keep, -1) < hits + run:
                        nxt[keep] = hits + run
        states = nxt
    return max(states.values()) * page_size


def tree_requests(paths, partial):
    """Requests whose block ids name prefixes: a path of branch choices maps to the ids of its prefixes."""
    ids, out = {}, []
    for i, (path, cut) in enumerate(zip(paths, partial)):
        blocks = [ids.setdefault(tuple(path[: d + 1]), len(ids)) for d in range(len(path))]
        out.append(request(i, blocks, 512 * len(blocks) - cut))
    return out


@settings(max_examples=40, deadline=None)
@given(paths=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=3), min_size=1, max_size=6),
       cuts=st.lists(st.sampled_from([0, 0, 200]), min_size=6, max_size=6),
       capacity_pages=st.integers(0, 4), page_size=st.sampled_from([256, 512]))
def test_min_equals_exhaustive_optimum(paths, cuts, capacity_pages, page_size):
    requests = tree_requests(paths, cuts)
    result = belady_min(requests, capacity_pages * page_size, page_size)
    assert result.hit_tokens == brute_force_best(requests, capacity_pages, page_size)


def reference_unbounded(requests, page_size):
    trie, hits = {}, []
    for req in requests:
        tokens = req.prompt_tokens()
        pages = [tuple(tokens[i:i + page_size]) for i in range(0, len(tokens) // page_size * page_size, page_size)]
        node, hit = trie, 0
        for p in pages:
            if p not in node:
                break
            node, hit = node[p], hit + page_size
        hits.append(hit)
        node = trie
        for p in pages:
            node = node.setdefault(p, {})
    return hits


@pytest.mark.parametrize("page_size", [1, 16, 100])
def test_unbounded_min_is_the_ideal_prefix_hit(page_size):
    requests = load_trace(FIXTURE, limit=60).requests
    result = belady_min(requests, None, page_size)
    assert result.per_request_hit_tokens == reference_unbounded(requests, page_size)


def test_min_is_monotone_in_capacity_and_prefix_closed_example():
    requests = load_trace(FIXTURE).requests
    ratios = [belady_min(requests, c, 16).hit_ratio for c in (0, 5_000, 20_000, 100_000, None)]
    assert ratios[0] == 0.0
    assert ratios == sorted(ratios)
    # two requests sharing two blocks, one page of room: MIN keeps the first page of the shared prefix
    reqs = [request(0, [1, 2]), request(1, [1, 2]), request(2, [1, 3])]
    assert belady_min(reqs, 512, 512).per_request_hit_tokens == [0, 512, 512]


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        belady_min([], 10, 0)
    with pytest.raises(ValueError, match="capacity_tokens"):
        belady_min([], -1, 16)


def reference_min(requests, capacity_pages, page_size):
    """MIN page by page (no segments, no packed heap): a page is (prefix of block ids, page index)."""
    uses = []
    for req in requests:
        whole = req.input_length // page_size
        uses.append([(tuple(req.hash_ids[: (k * page_size + page_size - 1) // 512 + 1]), k) for k in range(whole)])
    following, nexts = {}, [None] * len(uses)
    for r in range(len(uses) - 1, -1, -1):
        nexts[r] = [following.get(p, 1 << 40) for p in uses[r]]
        following.update((p, r) for p in uses[r])
    cached, hits = {}, []  # page -> its next use
    for pages, nxt in zip(uses, nexts):
        hits.append(page_size * next((i for i, p in enumerate(pages) if p not in cached), len(pages)))
        cached.update(zip(pages, nxt))
        while len(cached) > capacity_pages:  # farthest next use, then deepest
            del cached[max(cached, key=lambda p: (cached[p], p[1]))]
    return hits


@pytest.mark.parametrize("capacity_tokens", [3_000, 40_000])
@pytest.mark.parametrize("heap_slack", [8, 4096])
def test_min_matches_a_page_by_page_reference(capacity_tokens, heap_slack, monkeypatch):
    # a slack of 8 compacts MIN's heap (drops its stale entries) every few requests
    monkeypatch.setattr(optimal, "_HEAP_SLACK", heap_slack)
    requests = load_trace(FIXTURE, limit=80).requests
    got = belady_min(requests, capacity_tokens, 16).per_request_hit_tokens
    assert got == reference_min(requests, capacity_tokens // 16, 16)


def test_min_at_several_capacities_builds_one_workload_with_the_same_results():
    requests = load_trace(FIXTURE).requests
    capacities = [20_000, None, 5_000]
    several = belady_mins(requests, capacities, 16)
    assert [r.per_request_hit_tokens for r in several] == [
        belady_min(requests, c, 16).per_request_hit_tokens for c in capacities]
    assert [r.capacity_tokens for r in several] == capacities
