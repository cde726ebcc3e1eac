"""The persistent eviction heap evicts in the order a fresh heap over the whole frontier gives.

Two trees get the same random operations; one evicts through :class:`EvictionHeap`, the other through
the per-call :func:`eviction_order` over the frontier (the way every eviction worked before). Every
policy, both tier modes; locks, host copies, touches and key rises without an event (hit counts) mixed in.
"""

import gc
import random
import weakref

import pytest
import torch

from tierkv.eviction import POLICIES, eviction_order, get_policy
from tierkv.eviction.heap import EvictionHeap
from tierkv.eviction.tiers import tier_orders
from tierkv.radix import RadixKey, RadixTree

pytestmark = pytest.mark.usefixtures("tree_impl")  # every test: compiled and pure-Python tree


def _prefix(tree, node) -> tuple:
    return tuple(e for n in tree.path_to_root(node) for e in n.key)


class _Side:
    """One tree and its policy; ``persistent`` picks the eviction mechanism."""

    def __init__(self, policy: str, tier_mode: str, persistent: bool, batch: bool = False) -> None:
        self.batch = batch  # device evictions through EvictionHeap.evict_device
        self.tree = RadixTree(2)
        self.policy = get_policy(policy)
        self.orders = dict(zip(("device", "host"), tier_orders(self.policy, tier_mode)))
        self.heaps = {t: EvictionHeap(self.tree, t, o) for t, o in self.orders.items()} if persistent else None
        self.locked = []

    def victims(self, tier: str):
        if self.heaps is not None:
            return self.heaps[tier].victims()
        tree = self.tree
        is_candidate = tree.is_device_leaf if tier == "device" else tree.is_host_leaf
        frontier = tree.device_leaves() if tier == "device" else tree.host_leaves()

        def next_leaf(node):
            return node.parent if is_candidate(node.parent) else None
        return eviction_order(frontier, self.orders[tier], next_leaf)

    def insert(self, ids: list[int]) -> None:
        result = self.tree.insert(RadixKey(ids), list(range(len(ids))))
        revived = {id(n) for n in result.revived}
        for node in result.path:
            if id(node) not in revived:
                self.policy.on_access(node)
        if result.new_node is not None:
            self.policy.on_insert(result.new_node)

    def node_at(self, ids: list[int]):
        return self.tree.match(RadixKey(ids), touch=False).last_node

    def copy_to_host(self, ids: list[int]) -> None:
        node = self.node_at(ids)
        while node is not None and node is not self.tree.root and node.host_value is None:
            node.host_value = list(range(len(node)))
            node = node.parent

    def evict(self, tier: str, num_tokens: int) -> list[tuple]:
        if self.batch and tier == "device":
            freed, nodes, values = self.heaps[tier].evict_device(num_tokens, self.policy.on_evict)
            assert freed == sum(map(len, nodes)) and [len(v) for v in values] == list(map(len, nodes))
            return [_prefix(self.tree, node) for node in nodes]
        out, freed = [], 0
        for node in self.victims(tier) if num_tokens > 0 else ():
            out.append(_prefix(self.tree, node))
            freed += len(node)
            if tier == "device":
                self.tree.clear_device_value(node)
                removed = node.host_value is None
            else:
                node.host_value = None
                removed = node.device_value is None
            if removed:
                self.tree.remove_leaf(node)
            self.policy.on_evict(node, removed)
            if freed >= num_tokens:
                break
        return out


def _step(rng: random.Random, sides: list[_Side], keys: list[list[int]]) -> None:
    ids = rng.choice(keys)
    op = rng.random()
    if op < 0.35:
        for s in sides:
            s.insert(ids)
    elif op < 0.5:
        for s in sides:
            s.tree.match(RadixKey(ids))
    elif op < 0.6:
        nodes = [s.node_at(ids) for s in sides]  # every side: a match may split
        if all(n is not None and n.device_value is not None for n in nodes):
            for s, node in zip(sides, nodes):
                s.tree.inc_lock_ref(node)
                s.locked.append(node)
    elif op < 0.7:
        if sides[0].locked:
            i = rng.randrange(len(sides[0].locked))
            for s in sides:
                s.tree.dec_lock_ref(s.locked.pop(i))
    elif op < 0.8:
        for s in sides:
            s.copy_to_host(ids)
    elif op < 0.85:
        bump = rng.randrange(1, 6)
        for s in sides:
            node = s.node_at(ids)
            if node is not None:  # keys that rise with no tree event
                node.hit_count += bump
                node.priority += bump
    else:
        tier, num = rng.choice(["device", "host"]), rng.randrange(1, 12)
        orders = [s.evict(tier, num) for s in sides]
        assert all(o == orders[0] for o in orders), (tier, num, orders)
    for s in sides:
        s.tree.check_integrity()


@pytest.mark.parametrize("tier_mode", ["inclusive", "exclusive"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_heap_order_matches_a_fresh_heap_over_the_frontier(policy, tier_mode):
    for seed in range(4):
        rng = random.Random(seed)
        stems = [[rng.randrange(4) for _ in range(2 * rng.randrange(1, 4))] for _ in range(5)]
        keys = [stem + [rng.randrange(4) for _ in range(2 * rng.randrange(0, 3))] for stem in stems for _ in range(3)]
        sides = [_Side(policy, tier_mode, persistent=True), _Side(policy, tier_mode, persistent=False),
                 _Side(policy, tier_mode, persistent=True, batch=True)]
        for _ in range(300):
            _step(rng, sides, keys)


def test_stopping_early_keeps_the_rest_for_the_next_call():
    tree = RadixTree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    nodes = [tree.insert(RadixKey([i]), [0]).new_node for i in range(4)]
    first = next(heap.victims())
    assert first is nodes[0]
    tree.clear_device_value(first)
    tree.remove_leaf(first)
    assert [n.id for n in heap.victims()] == [n.id for n in nodes[1:]]


def test_a_reset_tree_forgets_its_old_nodes():
    tree = RadixTree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    tree.insert(RadixKey([1]), [0])
    assert len(list(heap.victims())) == 1  # seen, not evicted
    tree.reset()
    fresh = tree.insert(RadixKey([2]), [0]).new_node
    assert [n.id for n in heap.victims()] == [fresh.id]


def test_bad_tier_is_refused():
    with pytest.raises(ValueError, match="'disk'"):
        EvictionHeap(RadixTree(), "disk", get_policy("lru"))


def test_a_kept_victim_marked_changed_is_offered_again():
    """What a cache does with a victim it may not evict yet (HiRadixCache.evict: host_ref protected)."""
    tree = RadixTree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    nodes = [tree.insert(RadixKey([i]), [0]).new_node for i in range(3)]
    first = next(heap.victims())
    assert first is nodes[0]
    tree.mark_changed("device", [first])
    assert [n.id for n in heap.victims()] == [n.id for n in nodes]
    with pytest.raises(ValueError, match="'disk'"):
        tree.mark_changed("disk", [first])


def test_sets_nobody_reads_are_not_kept_and_start_full_when_read():
    """Regression (a per-node cost): a tree without a host tier kept host change and frontier sets as large
    as the tree; each now starts at its first reader, holding every node with a value in its tier."""
    tree = _small_tree()
    frontiers = tree.root._frontiers
    assert (frontiers.device, frontiers.host, frontiers.device_changed, frontiers.host_changed) == (None,) * 4
    heap = EvictionHeap(tree, "device", get_policy("lru"))  # made after the inserts: it still sees them all
    assert frontiers.host_changed is None and frontiers.device is None
    freed, nodes, _ = heap.evict_device(100)
    assert freed == 5 and [list(n.key) for n in nodes] == [[3], [4], [1, 2], [5]]
    tree = _small_tree()
    tree.match(RadixKey([5])).last_node.host_value = [5]
    assert [list(n.key) for n in tree.host_leaves()] == [[5]]
    assert {tuple(n.key) for n in tree.device_leaves()} == {(3,), (4,), (5,)}
    tree.check_integrity()


def test_cache_eviction_checks_what_it_evicts_not_every_leaf(monkeypatch):
    """Regression: every L1 eviction used to scan and re-rank the whole leaf frontier to free a node."""
    import tierkv.radix as radix
    from tierkv.cache.config import CacheConfig
    from tierkv.cache.hicache import HiRadixCache
    from tierkv.pools import DeviceKVPool, KVSpec

    checks = []
    for name, owner in (("_is_device_leaf_node", radix), ("is_device_leaf", radix.RadixTree)):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real: checks.append(1) or real(*a))
    num_leaves = 400
    pool = DeviceKVPool(KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float16), 2 * num_leaves, 1, "cpu")
    cache = HiRadixCache(pool, CacheConfig())
    try:
        for i in range(num_leaves):
            cache.insert(RadixKey([i, i]), cache.alloc_device(2))
        cache.flush()  # write-throughs done: the leaves are unlocked
        cache.evict(2)  # the first call ranks every leaf once
        checks.clear()
        for _ in range(20):
            assert cache.evict(2) == 2
        assert len(checks) <= 20 * 4  # a few checks per node evicted, whatever the tree's size
        cache.tree.check_integrity()
    finally:
        cache.close()


def _small_tree():
    tree = RadixTree()
    for ids in ([1, 2, 3], [1, 2, 4], [5]):
        tree.insert(RadixKey(ids), list(ids))
    return tree


def test_evict_device_runs_the_compiled_loop_when_built(tree_impl, monkeypatch):
    tree = _small_tree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    if tree_impl == "c":  # the differential test compares the compiled loop, not a silent fallback
        monkeypatch.setattr(EvictionHeap, "_evict_device_python", lambda *a: pytest.fail("fell back"))
    hooked = []
    freed, nodes, values = heap.evict_device(100, lambda node, removed: hooked.append((node, removed)))
    assert freed == 5 and [list(n.key) for n in nodes] == [[3], [4], [1, 2], [5]]
    assert values == [[3], [4], [1, 2], [5]] and hooked == [(n, True) for n in nodes]
    assert tree.root.children == {} and tree.evictable_size == 0
    tree.check_integrity()


def test_evict_device_keeps_backed_up_nodes_and_refuses_other_tiers():
    tree = _small_tree()
    node = tree.match(RadixKey([5]), touch=False).last_node
    node.host_value = [50]
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    assert heap.evict_device(0) == (0, [], [])
    freed, nodes, _ = heap.evict_device(1)
    assert freed == 1 and [list(n.key) for n in nodes] == [[3]]  # stops once enough is freed
    while heap.evict_device(1)[0]:
        pass
    assert list(tree.root.children.values()) == [node] and node.device_value is None  # host-only now
    tree.check_integrity()
    with pytest.raises(ValueError, match="device tier"):
        EvictionHeap(tree, "host", get_policy("lru")).evict_device(1)


def test_keys_the_compiled_loop_reads_from_slots_equal_the_key_functions():
    from tierkv.eviction.heap import _SLOT_KEYS

    tree = _small_tree()
    policy = get_policy("lru")
    for function, slot in _SLOT_KEYS.items():
        for node in tree.nodes():
            assert (getattr(node, slot), node.id) == function(policy, node)


def test_evict_device_without_nodes_gives_the_same_values_and_releases_the_nodes(tree_impl):
    """``keep_nodes=False`` (a caller that only frees slots): same tokens and values in the same order,
    an empty node list, and every node removed from the tree released by the call itself."""
    import gc

    from tierkv.radix import TreeNode

    def build():
        tree = _small_tree()
        for ids in ([1, 2, 3, 6, 7], [1, 2, 3, 6, 7, 8], [9, 9]):  # a chain of turns, one more root child
            tree.insert(RadixKey(ids), list(ids))
        return tree, EvictionHeap(tree, "device", get_policy("lru"))

    kept_tree, kept_heap = build()
    freed, nodes, values = kept_heap.evict_device(100)
    tree, heap = build()
    gc.disable()  # released by reference counting inside the call, not by a later collection
    try:
        assert heap.evict_device(100, keep_nodes=False) == (freed, [], values)
        frontiers = tree.root._frontiers
        left = [o for o in gc.get_objects() if type(o) is TreeNode and o._frontiers is frontiers]
    finally:
        gc.enable()
    assert left == [tree.root] and len(nodes) == 7
    tree.check_integrity()


def test_a_cold_tree_marks_its_leaves_not_its_inner_nodes():
    """Regression (a per-node cost): every node a match or insert touched stayed marked for the eviction
    heap, so the first eviction of a cold tree ranked every inner node of every conversation; only nodes
    that can be candidates (the deepest holding device slots on a path) are marked now."""
    tree = RadixTree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    turns = [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]  # one conversation: a chain of three nodes
    for ids in turns + [[1, 2, 7]]:  # and a second branch under the first turn
        tree.insert(RadixKey(ids), list(ids))
    tree.match(RadixKey(turns[-1]))
    marked = {tuple(n.key) for n in tree.changed_nodes("device")}
    assert marked == {(5, 6), (7,)} == {tuple(n.key) for n in tree.device_leaves()}
    freed, nodes, _ = heap.evict_device(100)
    assert freed == 7 and [list(n.key) for n in nodes] == [[7], [5, 6], [3, 4], [1, 2]]
    tree.check_integrity()


def test_a_parent_with_many_children_is_evicted_after_the_last_of_them(tree_impl):
    """The compiled loop scans a parent's children from where it last found one holding slots, and
    looks a child up by key under a parent of many: the parent still goes only after its last child."""
    tree = RadixTree()
    heap = EvictionHeap(tree, "device", get_policy("lru"))
    for k in range(1, 13):
        tree.insert(RadixKey([1, 2, k]), [1, 2, k])
    tree.match(RadixKey([1, 2, 12]))  # the last child inserted is the most recent: the others go first
    freed, nodes, _ = heap.evict_device(100)
    assert freed == 14 and [list(n.key) for n in nodes] == [[k] for k in range(1, 13)] + [[1, 2]]
    assert tree.root.children == {}
    tree.check_integrity()


class _Slots(list):
    """A device value a test can watch die (a list subclass takes weak references; slices stay _Slots)."""

    def __getitem__(self, index):
        got = super().__getitem__(index)
        return _Slots(got) if isinstance(index, slice) else got


def _watched_tree():
    tree = RadixTree()
    for ids in ([1, 2, 3], [1, 2, 4], [1, 2, 4, 5, 6], [7], [7, 8, 9]):  # splits, a chain, root children
        tree.insert(RadixKey(ids), _Slots(ids))
    values = [n.device_value for n in tree.nodes() if n.device_value is not None]
    return tree, EvictionHeap(tree, "device", get_policy("lru")), [weakref.ref(v) for v in values]


@pytest.mark.parametrize("keep_nodes", [True, False])
def test_evict_device_hands_back_each_value_with_the_one_reference_the_tree_held(tree_impl, keep_nodes):
    """The compiled loop moves a value's reference from its node to the list it returns: none is added
    (a leak) or lost (a value freed under the caller)."""
    import sys

    tree, heap, watched = _watched_tree()
    freed, nodes, values = heap.evict_device(100, keep_nodes=keep_nodes)
    assert freed == 9 and len(values) == len(watched) and len(nodes) == (len(watched) if keep_nodes else 0)
    del tree, heap, nodes
    gc.collect()
    assert [sys.getrefcount(values[i]) for i in range(len(values))] == [2] * len(values)  # the list's own
    assert sorted(map(id, values)) == sorted(id(w()) for w in watched)
    del values
    assert [w() for w in watched] == [None] * len(watched)


def test_an_on_evict_hook_that_raises_leaks_no_value(tree_impl):
    """An error inside the loop propagates; the values evicted before it are dropped with the call's
    frame (as the Python loop drops its list), not kept alive by the compiled loop."""
    tree, heap, watched = _watched_tree()
    calls = []

    def hook(node, removed):
        calls.append(node)
        if len(calls) == 2:
            raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        heap.evict_device(100, hook)
    assert len(calls) == 2 and all(n.device_value is None for n in calls)
    del tree, heap, calls
    gc.collect()
    assert [w() for w in watched] == [None] * len(watched)


@pytest.mark.parametrize("enabled_before", [True, False])
@pytest.mark.parametrize("hook_raises", [False, True])
def test_the_collector_is_as_the_caller_left_it_after_an_eviction(tree_impl, enabled_before, hook_raises):
    """The compiled loop pauses the cyclic collector while it runs (its heap entries would trigger young
    collections that walk them all); afterwards, error or not, the collector is on exactly when it was."""
    tree, heap, _ = _watched_tree()
    seen = []

    def hook(node, removed):
        seen.append(gc.isenabled())
        if hook_raises:
            raise RuntimeError("hook failed")

    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        if hook_raises:
            with pytest.raises(RuntimeError, match="hook failed"):
                heap.evict_device(100, hook)
        else:
            heap.evict_device(100, hook)
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()
    assert seen
    if tree_impl == "c":
        assert seen == [False] * len(seen)  # paused inside the loop
