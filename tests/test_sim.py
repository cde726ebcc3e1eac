"""The page simulator's HiCache-comparison options (issue 13 items 5 and 6) on tiny trees.

One page per 512-token trace block (page_size 512), so each request's blocks are its pages.
"""

import pytest

from tierkv.radix import RadixKey
from tierkv.replay.sim import PageSim, SimConfig
from tierkv.replay.trace import BLOCK_TOKENS, TraceRequest

PAGE = BLOCK_TOKENS


def _req(index: int, *blocks: int) -> TraceRequest:
    return TraceRequest(index, index + 1, index, PAGE * len(blocks), 0, tuple(blocks))


def _node(sim: PageSim, *blocks: int):
    """The node whose key ends with the last of ``blocks`` (which must end a node: a match would split)."""
    path = sim.tree.match(RadixKey(_req(0, *blocks).prompt_tokens()), touch=False)
    assert path.num_tokens == PAGE * len(blocks)
    return path.last_node


def _sim(**kwargs) -> PageSim:
    return PageSim(SimConfig(page_size=1, eviction_policy="lru", **kwargs))


def _serve(sim: PageSim, *requests: tuple[int, ...]) -> list[int]:
    return [sim.serve(_req(i, *blocks)) for i, blocks in enumerate(requests)]


def test_l2_eviction_of_l1_resident_copies_tierkv_rule_vs_hicache_rule():
    """L2 smaller than L1 (1 page vs 2). Writing B through needs room: tierkv's rule drops the L2 copy
    of A, still in L1; HiCache's evicts only host-only leaves, finds none, and B stays unwritten (the
    starvation of HiCache issue #33862). C then makes L1 evict A: tierkv deletes it, HiCache keeps it
    host-only until C's own write evicts it from L2."""
    l1, l2 = 2 * PAGE, PAGE
    tierkv, hicache = _sim(l1_tokens=l1, l2_tokens=l2), _sim(l1_tokens=l1, l2_tokens=l2, l2_evicts_l1_resident=False)
    for sim in (tierkv, hicache):
        assert _serve(sim, (1,), (2,)) == [0, 0]
    a, b = _node(tierkv, 1), _node(tierkv, 2)
    assert a.device_value is not None and a.host_value is None and b.host_value is not None
    a, b = _node(hicache, 1), _node(hicache, 2)
    assert a.device_value is not None and a.host_value is not None and b.host_value is None
    assert tierkv.result.written_tokens == 2 * PAGE and hicache.result.written_tokens == PAGE
    assert [tierkv.serve(_req(2, 3)), hicache.serve(_req(2, 3))] == [0, 0]
    for sim in (tierkv, hicache):
        assert 1 * PAGE not in sim.tree.root.children and _node(sim, 3).host_value is not None
    assert tierkv.result.written_tokens == 3 * PAGE and hicache.result.written_tokens == 2 * PAGE


def test_write_back_copies_ancestors_with_the_leaf_or_when_they_are_evicted():
    """Write-back of leaf L under parent P, both only in L1: the default copies P with L (2 pages at
    once); without ancestors only L, and P when L1 evicts it in turn. The same pages are copied in the
    end, and the same hits follow."""
    figures = []
    for ancestors in (True, False):
        sim = _sim(l1_tokens=2 * PAGE, l2_tokens=4 * PAGE, write_threshold=None, write_back_ancestors=ancestors)
        _serve(sim, (1,), (1, 2), (3,))  # C needs room: L1 evicts leaf L = (1, 2) and writes it back
        parent, leaf = _node(sim, 1), _node(sim, 1, 2)
        assert leaf.device_value is None and leaf.host_value is not None
        assert (parent.host_value is not None) == ancestors and parent.device_value is not None
        written_at_leaf = sim.result.written_tokens
        hits = _serve(sim, (4,), (1, 2))  # D evicts P from L1; then P, L come back from L2
        figures.append((written_at_leaf, sim.result.written_tokens, hits))
    (eager_first, eager_total, eager_hits), (lazy_first, lazy_total, lazy_hits) = figures
    assert (eager_first, lazy_first) == (2 * PAGE, PAGE)
    assert eager_total == lazy_total and eager_hits == lazy_hits == [0, 2 * PAGE]


def test_lazy_ancestors_lose_the_l2_leaf_when_the_ancestor_cannot_be_copied():
    """Without ancestor copies, L2 may hold a leaf whose parent is only in L1; if L1 then evicts the
    parent and L2 cannot hold it, the leaf's L2 copy is unreachable and goes too (the default copies
    the parent with the leaf, or not at all, so L2 never holds a page it cannot load)."""
    sim = _sim(l1_tokens=3 * PAGE, l2_tokens=PAGE, write_threshold=None, write_back_ancestors=False)
    _serve(sim, (1, 5), (1, 5, 2), (3,))  # L = (1, 5, 2) written back into the only L2 page
    assert _node(sim, 1, 5, 2).host_value is not None and _node(sim, 1, 5).host_value is None
    _serve(sim, (4, 6, 7))  # L1 evicts P = (1, 5), 2 pages, more than L2 holds: P and L are gone;
    assert 1 * PAGE not in sim.tree.root.children  # then C = (3,), whose copy takes the L2 page
    assert sim.l2_used == PAGE and _node(sim, 3).host_value is not None
    assert sim.result.written_tokens == 2 * PAGE


@pytest.mark.parametrize("load, b_hit", [
    (dict(load_chunk_tokens=0), 0),  # one load: L2 evicts all of B for C
    (dict(load_chunk_tokens=256), PAGE),  # chunks: the first chunk's demotions take the staging
    (dict(load_chunk_tokens=16), PAGE),  # (was PAGE - 256 and PAGE - 16: the first chunk's loss)
    (dict(load_chunk_tokens=PAGE), PAGE),  # one chunk: the whole load through the staging
    (dict(load_chunk_tokens=0, swap_loads=True), PAGE),  # the what-if: C takes A's slots at once
])
def test_a_load_back_makes_l2_evict_nothing_in_chunks(load, b_hit):
    """Exclusive tiers, L1 one block, L2 two. Loading A back makes L1 demote C while A's L2 copy still
    counts: in one load L2 (A, B) evicts B; in chunks the first chunk's demotions take the staging L2
    keeps free and each chunk's freed L2 slots the next one's, so all of B still hits, as with the swap
    what-if (C takes A's slots at once)."""
    sim = _sim(l1_tokens=PAGE, l2_tokens=2 * PAGE, tier_mode="exclusive", write_threshold=None, **load)
    assert _serve(sim, (1,), (2,), (3,), (1,), (2,)) == [0, 0, 0, PAGE, b_hit]
    assert sim.l2_used <= sim.l2_pages and sim.l1_in_flight == 0


def test_split_victims_evicts_only_the_pages_it_needs():
    """L1 two blocks: a one-block request after a two-block one takes only one block of it."""
    for split, kept in ((False, 0), (True, PAGE)):
        sim = _sim(l1_tokens=2 * PAGE, split_victims=split)
        assert _serve(sim, (1, 2), (3,), (1, 2)) == [0, 0, kept]


def test_evict_whole_length_on_an_l2_write_drops_what_the_shortfall_keeps():
    """L2 four blocks holding A and B, two free; writing C (3 blocks) through needs one more: tierkv
    evicts A alone (the shortfall), HiCache's rule three blocks' worth (A and B), so B then misses."""
    hits = []
    for whole in (False, True):
        sim = _sim(l1_tokens=3 * PAGE, l2_tokens=4 * PAGE, evict_whole_length=whole)
        hits.append(_serve(sim, (1,), (2,), (3, 4, 5), (2,)))
        assert sim.l2_used <= sim.l2_pages
    assert hits == [[0, 0, 0, PAGE], [0, 0, 0, 0]]


def test_refresh_split_tail_keeps_the_unmatched_tail_of_a_split_node():
    """L1 three blocks. Matching the head of (1, 2) splits it: tierkv leaves the tail (2) its old time,
    so it goes before (3); HiCache's rule refreshes the tail too, so (3) goes and (1, 2) hits whole."""
    hits = []
    for refresh in (False, True):
        sim = _sim(l1_tokens=3 * PAGE, refresh_split_tail=refresh)
        hits.append(_serve(sim, (1, 2), (3,), (1,), (4,), (1, 2)))
    assert hits == [[0, 0, PAGE, 0, PAGE], [0, 0, PAGE, 0, 2 * PAGE]]


@pytest.mark.parametrize("policy", ["lfu", "slru"])
def test_lfu_under_write_back_is_lru_unless_it_counts_uses(policy):
    """L1 two blocks, write_back: (1) is used twice, then (2), (3). Counting uses (tierkv before) keeps
    (1) and evicts (2); HiCache's rule counts none there, so LRU order evicts (1)."""
    hits = []
    for counts in (False, True):
        sim = PageSim(SimConfig(l1_tokens=2 * PAGE, page_size=1, eviction_policy=policy, write_threshold=None,
                                write_back_counts_uses=counts))
        hits.append(_serve(sim, (1,), (1,), (2,), (3,), (1,)))
    assert hits == [[0, PAGE, 0, 0, 0], [0, PAGE, 0, 0, PAGE]]
