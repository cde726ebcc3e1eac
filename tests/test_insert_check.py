"""HiRadixCache.insert's slot handling (tierkv/cache/node_slots.py, tierkv/_radix_slots.c): the slots the
tree takes or frees are checked as one set with those it keeps, the caller's copies of KV the tree holds are
freed, a bad call changes nothing, and a match gathers its prefix's slots. Every test runs on the compiled
helpers and on their numpy reference."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierkv.cache import node_slots
from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools.allocator import slack_bytes
from tierkv.pools.kv import DeviceKVPool
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey, RadixTree
from tierkv.radix_walk import common_prefix_len, walk_python

SPEC = KVSpec(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)


@pytest.fixture(params=["c", "numpy"])
def slots_impl(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(node_slots, "native_gather", None)
        monkeypatch.setattr(node_slots, "native_plan_slots", None)
    elif node_slots.native_plan_slots is None:
        pytest.skip("tierkv._radix is not built")
    return request.param


def make_cache(page_size: int = 1, num_slots: int = 256) -> HiRadixCache:
    pool = DeviceKVPool(SPEC, num_slots, page_size, "cpu")
    return HiRadixCache(pool, CacheConfig(page_size=page_size, enable_host=False))


def state(cache: HiRadixCache) -> tuple:
    """What a refused insert must leave as it was: the tree's nodes and values, and the free slots."""
    nodes = sorted((tuple(n.key), tuple(n.device_value.tolist())) for n in cache.tree.nodes())
    return nodes, cache.device_pool.num_free_slots, cache.evictable_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_callers_copies_of_cached_slots_are_freed(slots_impl, page_size):
    cache = make_cache(page_size)
    first = cache.alloc_device(16)
    assert cache.insert(RadixKey(list(range(16))), first) == 16
    again = cache.alloc_device(24)  # the same 16 tokens recomputed into other slots, then 8 new ones
    free_before = cache.device_pool.num_free_slots
    assert cache.insert(RadixKey(list(range(24))), again) == 24
    assert cache.device_pool.num_free_slots == free_before + 16  # the recomputed copy went back
    match = cache.match_prefix(RadixKey(list(range(24))))
    assert match.device_indices.tolist() == first.tolist() + again[16:].tolist()
    cache.check_integrity()


def test_only_the_slots_that_differ_are_freed(slots_impl):
    cache = make_cache()
    first = cache.alloc_device(8)
    cache.insert(RadixKey(list(range(8))), first)
    mixed = torch.cat([first[:4], cache.alloc_device(4), cache.alloc_device(4)])  # half the prefix recomputed
    free_before = cache.device_pool.num_free_slots
    assert cache.insert(RadixKey(list(range(12))), mixed) == 12
    assert cache.device_pool.num_free_slots == free_before + 4
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_free_slot_in_the_new_part_is_refused_and_changes_nothing(slots_impl, page_size):
    cache = make_cache(page_size)
    cache.insert(RadixKey(list(range(8))), cache.alloc_device(8))
    slots = cache.match_prefix(RadixKey(list(range(8)))).device_indices
    new = cache.alloc_device(8)
    cache.device_pool.free(new[-page_size:])
    before = state(cache)
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(RadixKey(list(range(16))), torch.cat([slots, new]))
    assert state(cache) == before
    cache.check_integrity(caller_device_slots=new[:-page_size])


def test_a_slot_given_twice_is_refused_and_changes_nothing(slots_impl):
    cache = make_cache()
    new = cache.alloc_device(8)
    twice = torch.cat([new[:4], new[:4]])
    before = state(cache)
    with pytest.raises(ValueError, match="more than once"):
        cache.insert(RadixKey(list(range(8))), twice)
    assert state(cache) == before
    cache.check_integrity(caller_device_slots=new)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("where", ["freed", "taken"])
def test_a_slot_repeating_one_the_tree_keeps_is_refused(slots_impl, page_size, where):
    """CI found it: re-inserting cached tokens with one page replaced by the tree's next page freed that page
    under the live node (and a new leaf could take a page the tree keeps, owned twice)."""
    cache = make_cache(page_size)
    first = cache.alloc_device(4 * page_size)
    cache.insert(RadixKey(list(range(4 * page_size))), first)
    fresh = cache.alloc_device(0 if where == "freed" else page_size)
    bad = torch.cat([first, fresh])
    key = RadixKey(list(range(len(bad))))
    target = 0 if where == "freed" else 4
    bad[target * page_size:(target + 1) * page_size] = first[page_size:2 * page_size]
    before = state(cache)
    with pytest.raises(ValueError):
        cache.insert(key, bad)
    assert state(cache) == before
    cache.check_integrity(caller_device_slots=fresh)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("repeat", ["lowest", "highest", "none, in the gap"])
def test_the_kept_slots_check_skips_only_runs_whose_range_misses_the_pages_taken(slots_impl, page_size, repeat):
    """The compiled check reads the path's kept slots only where their range meets the pages taken (a
    3,000-token prompt at page 1 cost 3,000 reads an insert). A node keeping two distant runs of pages (a gap
    the caller owns between them): a new page inside its range but in the gap is taken; the node's lowest
    or highest page given again is refused, the cache unchanged."""
    cache = make_cache(page_size)
    low, gap, high = (cache.alloc_device(4 * page_size) for _ in range(3))
    kept = torch.cat([low, high])
    cache.insert(RadixKey(list(range(8 * page_size))), kept)
    new_page = {"lowest": low[:page_size], "highest": high[-page_size:], "none, in the gap": gap[:page_size]}[repeat]
    slots = torch.cat([kept, new_page])
    key = RadixKey(list(range(9 * page_size)))
    before = state(cache)
    if repeat == "none, in the gap":
        assert cache.insert(key, slots) == 9 * page_size
        assert cache.match_prefix(key).device_indices.tolist() == slots.tolist()
        cache.check_integrity(caller_device_slots=gap[page_size:])
        return
    with pytest.raises(ValueError, match="tree's own"):
        cache.insert(key, slots)
    assert state(cache) == before
    cache.check_integrity(caller_device_slots=gap)


@pytest.mark.parametrize("flaw", ["misaligned", "past the pool", "a free page inside", "none"])
def test_a_new_part_given_as_one_run_of_slots_is_checked_page_by_page(slots_impl, flaw):
    """The compiled check takes an ascending run of slots (what the allocator hands out) as one range of
    pages: it must still refuse a run that starts inside a page, reaches past the pool or holds a free page,
    changing nothing, and take a sound one."""
    cache = make_cache(page_size=4, num_slots=64)
    held = cache.alloc_device(64)
    cache.device_pool.free(held[:16])  # the last 48 slots stay the caller's
    num_slots = 64
    runs = {"misaligned": torch.arange(18, 34), "past the pool": torch.arange(num_slots - 8, num_slots + 8),
            "a free page inside": torch.arange(4, 20), "none": torch.arange(16, 32)}
    slots = runs[flaw].to(torch.int64)
    before = state(cache)
    if flaw == "none":
        assert cache.insert(RadixKey(list(range(16))), slots) == 16
        cache.check_integrity(caller_device_slots=held[32:])
        return
    with pytest.raises(ValueError):
        cache.insert(RadixKey(list(range(16))), slots)
    assert state(cache) == before
    cache.check_integrity(caller_device_slots=held[16:])


@pytest.mark.parametrize("where", [0, 7, 13, 21, 34, 36])
def test_a_long_nodes_lowest_and_highest_slot_and_a_recomputed_one_are_seen_wherever_they_lie(slots_impl, where):
    """The compiled compare of the caller's slots with a node's reads 16 at a time in four lanes of
    accumulators, then a tail: a node of 37 slots (page 1) whose lowest slot lies at ``where`` and highest
    18 further on (in each lane of the body, and in the tail): giving either again as a new slot is
    refused, the cache unchanged; a recomputed slot at ``where`` is freed as the caller's copy."""
    cache = make_cache(page_size=1, num_slots=128)
    block = cache.alloc_device(64)
    low, high = int(block[2]), int(block[60])
    between = iter(block[10:45].tolist())  # 35 slots strictly between the lowest and the highest
    placed = {where: low, (where + 18) % 37: high}
    kept = torch.tensor([placed[i] if i in placed else next(between) for i in range(37)], dtype=torch.int64)
    assert len(kept) == 37 and int(kept[where]) == low and int(kept.argmax()) == (where + 18) % 37
    key = RadixKey(list(range(37)))
    assert cache.insert(key, kept) == 37
    caller = torch.tensor(sorted(set(block.tolist()) - set(kept.tolist())), dtype=torch.int64)
    longer = RadixKey(list(range(38)))
    for repeat in (low, high):
        before = state(cache)
        with pytest.raises(ValueError, match="tree's own"):
            cache.insert(longer, torch.cat([kept, torch.tensor([repeat])]))
        assert state(cache) == before
    fresh = int(caller[0])
    recomputed = kept.clone()
    recomputed[where] = fresh
    free_before = cache.device_pool.num_free_slots
    assert cache.insert(key, recomputed) == 37
    assert cache.device_pool.num_free_slots == free_before + 1  # the caller's copy went back
    assert cache.match_prefix(key).device_indices.tolist() == kept.tolist()
    cache.check_integrity(caller_device_slots=caller[1:])


@pytest.mark.parametrize("page_size", [3, 4, 16])
@pytest.mark.parametrize("flaw", ["none", "a page's last slot from another page", "misaligned page",
                                  "a page given twice", "a free page", "past the pool"])
def test_a_new_part_of_scattered_pages_is_checked_page_by_page(slots_impl, page_size, flaw):
    """After eviction the allocator hands a prompt scattered pages, which the compiled check reads in one
    vectorised pass (four vectors a page at page 16) and then flags page by page. A flaw in the fifth of
    six pages is refused, the cache unchanged: the four pages flagged before it are flagged back, a free
    page stays free. Sound scattered pages are taken. Page 3 checks the division used where a page is not
    a power of two."""
    num_pages = 16
    cache = make_cache(page_size=page_size, num_slots=num_pages * page_size)
    held = cache.alloc_device(num_pages * page_size)
    pages = [held[p * page_size:(p + 1) * page_size] for p in range(num_pages)]
    cache.device_pool.free(pages[15])  # page 15 free, the rest the caller's
    order = [9, 2, 12, 5, 7, 0]  # not one ascending run
    chosen = [pages[p].clone() for p in order]
    if flaw == "a page's last slot from another page":
        chosen[4][-1] = pages[14][-1]
    elif flaw == "misaligned page":
        chosen[4] = torch.cat([pages[7][1:], pages[8][:1]])
    elif flaw == "a page given twice":
        chosen[4] = pages[2].clone()
    elif flaw == "a free page":
        chosen[4] = pages[15].clone()
    elif flaw == "past the pool":
        chosen[4] = torch.arange(num_pages * page_size, (num_pages + 1) * page_size, dtype=torch.int64)
    slots = torch.cat(chosen)
    key = RadixKey(list(range(6 * page_size)))
    before = state(cache)
    caller = torch.cat(pages[:15])
    if flaw == "none":
        assert cache.insert(key, slots) == 6 * page_size
        assert cache.match_prefix(key).device_indices.tolist() == slots.tolist()
        cache.check_integrity(caller_device_slots=torch.cat([pages[p] for p in range(15) if p not in order]))
        return
    with pytest.raises(ValueError):
        cache.insert(key, slots)
    assert state(cache) == before
    cache.check_integrity(caller_device_slots=caller)
    good = torch.cat([pages[p] for p in order])  # the flags flipped while checking were all put back
    assert cache.insert(key, good) == 6 * page_size
    cache.check_integrity(caller_device_slots=torch.cat([pages[p] for p in range(15) if p not in order]))


@pytest.mark.parametrize("repeat", [None, 0, 10])
def test_a_path_of_more_nodes_than_the_check_keeps_inline_is_checked_whole(slots_impl, repeat):
    """The compiled check keeps the path's runs inline up to 8 nodes, then moves them to the heap: a path of
    12 nodes (12 growing prompts) is compared and checked whole; a new page repeating a page of its first or
    eleventh node is refused, the cache unchanged."""
    cache = make_cache(page_size=4, num_slots=256)
    slots = torch.empty(0, dtype=torch.int64)
    for depth in range(1, 13):
        slots = torch.cat([slots, cache.alloc_device(4)])
        cache.insert(RadixKey(list(range(4 * depth))), slots)
    assert len(cache.tree.match(RadixKey(list(range(48)))).nodes) == 12
    new_page = cache.alloc_device(4) if repeat is None else slots[4 * repeat:4 * repeat + 4]
    key = RadixKey(list(range(52)))
    before = state(cache)
    if repeat is None:
        assert cache.insert(key, torch.cat([slots, new_page])) == 52
        cache.check_integrity()
        return
    with pytest.raises(ValueError, match="tree's own"):
        cache.insert(key, torch.cat([slots, new_page]))
    assert state(cache) == before
    cache.check_integrity()


def test_a_misaligned_page_is_refused(slots_impl):
    cache = make_cache(page_size=4)
    new = cache.alloc_device(8)
    with pytest.raises(ValueError, match="aligned"):
        cache.insert(RadixKey(list(range(8))), torch.cat([new[1:4], new[:1], new[4:]]))
    cache.check_integrity(caller_device_slots=new)


def test_a_free_slot_among_the_duplicates_is_refused_and_changes_nothing(slots_impl):
    """A prefix slot unequal to the tree's is to be freed: it must be the caller's, allocated."""
    cache = make_cache()
    cache.insert(RadixKey(list(range(8))), cache.alloc_device(8))
    stray = cache.alloc_device(8)
    cache.device_pool.free(stray)
    before = state(cache)
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(RadixKey(list(range(8))), stray)
    assert state(cache) == before
    cache.check_integrity()


def test_a_revived_node_takes_checked_slots(slots_impl):
    """A node without device slots on the path (its L1 copy evicted, kept for L2) adopts the caller's."""
    cache = make_cache()
    cache.insert(RadixKey(list(range(8))), cache.alloc_device(8))
    node = cache.tree.root.children[0]
    cache.device_pool.free(cache.tree.clear_device_value(node))
    node.host_value = torch.arange(8)  # stands for its L2 copy: the node stays in the tree
    recomputed = cache.alloc_device(12)
    cache.device_pool.free(recomputed[:1])
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(RadixKey(list(range(12))), recomputed)
    assert node.device_value is None
    recomputed = torch.cat([cache.alloc_device(1), recomputed[1:]])
    assert cache.insert(RadixKey(list(range(12))), recomputed) == 12
    assert node.device_value.tolist() == recomputed[:8].tolist()


def test_a_leaf_never_keeps_a_larger_caller_buffer_alive(slots_impl):
    """The scheduler passes request.slots[:n]: a leaf covering all n keeps a copy, not the request's buffer."""
    cache = make_cache(num_slots=4096)
    buffer = torch.cat([cache.alloc_device(64), torch.zeros(2048, dtype=torch.int64)])
    cache.insert(RadixKey(list(range(64))), buffer[:64])
    cache.insert(RadixKey(list(range(32)) + list(range(500, 532))), torch.cat([buffer[:32], cache.alloc_device(32)]))
    for node in cache.tree.nodes():
        own = node.device_value.nbytes
        assert node.device_value.untyped_storage().nbytes() - own <= slack_bytes(own)
    cache.check_integrity()


@pytest.mark.parametrize("caller", ["its own tensor", "a slice of a larger buffer", "strided"])
def test_a_new_leaf_slices_the_callers_tensor_only_when_that_pins_nothing_more(slots_impl, caller):
    """A new leaf alone taking slots (the usual insert) keeps a slice of the caller's tensor when the tensor
    is a contiguous CPU one of its own storage, within the slack of the leaf's part (what torch.cat of the
    prefix and new slots gives): no copy. A slice of a larger buffer, or a strided tensor, gets a contiguous
    value of its own; either way the leaf's slots are exact and outlive the caller's tensor."""
    cache = make_cache(page_size=4, num_slots=4096)
    prefix = cache.alloc_device(16)
    cache.insert(RadixKey(list(range(16))), prefix)
    new = cache.alloc_device(240)
    if caller == "its own tensor":
        slots = torch.cat([prefix, new])
    elif caller == "a slice of a larger buffer":
        slots = torch.cat([prefix, new, torch.zeros(4096, dtype=torch.int64)])[:256]
    else:
        slots = torch.stack([torch.cat([prefix, new]), torch.zeros(256, dtype=torch.int64)], dim=1)[:, 0]
        assert not slots.is_contiguous()
    key = RadixKey(list(range(256)))
    assert cache.insert(key, slots) == 256
    leaf = cache.tree.match(key).nodes[-1]
    value = leaf.device_value
    assert value.is_contiguous() and value.tolist() == new.tolist()
    assert (value.data_ptr() == slots.data_ptr() + 16 * 8) == (caller == "its own tensor")  # a slice, no copy
    assert value.untyped_storage().nbytes() - value.nbytes <= slack_bytes(value.nbytes)
    del slots
    assert cache.match_prefix(key).device_indices.tolist() == prefix.tolist() + new.tolist()
    cache.check_integrity()


@pytest.mark.parametrize("new_tokens", [8, 56])
def test_slots_not_readable_in_place_insert_as_a_contiguous_copy_does(slots_impl, new_tokens):
    """The compiled check reads the caller's tensor in place; a strided one (not contiguous) goes through its
    array: the tree ends up the same, each leaf owning no more than its slots (8 new tokens after a 56-token
    prefix: a copy of their own; 56 after 8: a view may stay)."""
    trees = []
    for strided in (False, True):
        cache = make_cache(num_slots=256)
        prefix_len = 64 - new_tokens
        first = cache.alloc_device(prefix_len)
        cache.insert(RadixKey(list(range(prefix_len))), first)
        slots = torch.cat([first, cache.alloc_device(new_tokens)])
        if strided:
            slots = torch.stack([slots, torch.zeros_like(slots)], dim=1)[:, 0]
            assert not slots.is_contiguous()
        assert cache.insert(RadixKey(list(range(64))), slots) == 64
        for node in cache.tree.nodes():
            own = node.device_value.nbytes
            assert node.device_value.untyped_storage().nbytes() - own <= slack_bytes(own)
        cache.check_integrity()
        trees.append(state(cache))
    assert trees[0] == trees[1]


def test_match_gathers_the_device_prefix_only(slots_impl):
    cache = make_cache()
    slots = cache.alloc_device(12)
    cache.insert(RadixKey(list(range(12))), slots)
    cache.insert(RadixKey(list(range(6)) + [99, 98]), torch.cat([slots[:6], cache.alloc_device(2)]))
    leaf = cache.match_prefix(RadixKey(list(range(12)))).last_device_node
    leaf.host_value = torch.arange(6)  # host-only from here: the device prefix ends above it
    cache.device_pool.free(cache.tree.clear_device_value(leaf))
    match = cache.match_prefix(RadixKey(list(range(12))))
    assert match.device_indices.tolist() == slots[:6].tolist() and match.host_hit_length == 6
    assert node_slots.device_prefix([])[1].tolist() == []


def test_native_slot_reads_refuse_a_tensor_they_cannot_read_in_place():
    if node_slots.native_gather is None:
        pytest.skip("tierkv._radix is not built")
    tree = RadixTree(1)
    node = tree.insert(RadixKey(list(range(4))), torch.arange(4, dtype=torch.int32)).new_node
    with pytest.raises(TypeError, match="contiguous int64 CPU"):
        node_slots.native_gather([node], torch.int64)
    node.device_value = torch.arange(8)[::2]  # four slots, strided
    with pytest.raises(TypeError, match="contiguous int64 CPU"):
        node_slots.native_gather([node], torch.int64)
    node.device_value = torch.arange(3)  # shorter than its key
    with pytest.raises(ValueError, match="expected at least 4"):
        node_slots.native_gather([node], torch.int64)


@pytest.mark.parametrize("page_size", [1, 2])
def test_the_compiled_walk_matches_the_reference(page_size):
    from tierkv.radix import native_walk

    if native_walk is None:
        pytest.skip("tierkv._radix is not built")
    rng = random.Random(page_size)
    tree = RadixTree(page_size)
    keys = []
    for _ in range(200):
        base = rng.choice(keys) if keys and rng.random() < 0.7 else []
        key = base[:rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        extra = rng.choice([None, "tenant"])
        keys.append(key)
        rkey = RadixKey(key, extra)
        elems, num = tree._walk_elements(rkey)
        native = native_walk(tree.root, elems, num, page_size, extra)
        reference = walk_python(tree.root, elems, num, page_size, extra, tree.child_key, common_prefix_len)
        assert native == reference
        tree.insert(rkey, list(range(num)))
    tree.check_integrity()


def test_on_access_all_counts_as_on_access_does():
    from tierkv.eviction import get_policy

    tree = RadixTree(1)
    a = tree.insert(RadixKey([1, 2]), [0, 1]).new_node
    b = tree.insert(RadixKey([1, 2, 3]), [0, 1, 2]).new_node
    for name in ("lru", "gdsf"):
        one, batch = get_policy(name), get_policy(name)
        for node in (a, b, a):
            one.on_access(node)
        batch.on_access_all([a, b, a])
        assert [one.uses(n) for n in (a, b)] == [batch.uses(n) for n in (a, b)] == [2, 1]


def test_the_compiled_slot_helpers_work_before_any_walk():
    """They read tree nodes through the layout the first walk binds; called first (a fresh process), they
    read slots at offset 0 and crashed the process."""
    if node_slots.native_gather is None:
        pytest.skip("tierkv._radix is not built")
    code = """
import torch
from array import array
from tierkv.cache.node_slots import native_gather
from tierkv.radix import TreeNode
root = TreeNode([], None, None, 0)
nodes = []
for i in range(3):
    node = TreeNode(array("q", range(4)), None, root, 0)
    node._device_value = torch.arange(4 * i, 4 * i + 4)
    nodes.append(node)
count, raw = native_gather(nodes, torch.int64)
print(count, torch.frombuffer(raw, dtype=torch.int64).tolist())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["3", str(list(range(12))) + "\n"]
