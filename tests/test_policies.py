"""The policies of the eviction package: victim order on tiny trees, hooks, admission, sharing with the
simulator (tierkv.replay.sim), and exclusive tiers in the real cache."""

import pytest
import torch

from tierkv.replay.replay import ReplayConfig, TraceReplayer, replay
from tierkv.replay.sim import from_cache_config, simulate
from tierkv.replay.trace import load_trace
from tierkv.cache.config import CacheConfig
from tierkv.eviction import POLICIES, eviction_order, fingerprint, get_policy
from tierkv.eviction.hitdensity import HitDensity
from tierkv.eviction.tiers import tier_orders
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool, KVSpec
from tierkv.radix import RadixKey, RadixTree

from tests.test_replay import FIXTURE


def _leaves(tree, specs):
    """Insert one leaf per (name, tokens); returns name -> node."""
    return {name: tree.insert(RadixKey(tokens), list(tokens)).new_node for name, tokens in specs}


def _order(policy, nodes) -> str:
    names = {n.id: k for k, n in nodes.items()}
    return "".join(names[n.id] for n in eviction_order(list(nodes.values()), policy, lambda n: None))


def _used(policy, tree, node, times=1):
    """A request uses ``node`` ``times`` more times, as the cache reports it (match, then the hooks)."""
    for _ in range(times):
        tree.match(RadixKey(list(node.key)))
        policy.on_access(node)


def _three(policy):
    """a created first and used again last; b created second; c created third and used three times."""
    tree = RadixTree()
    nodes = _leaves(tree, [("a", [1, 10]), ("b", [2, 20]), ("c", [3, 30])])
    for n in nodes.values():
        policy.on_access(n)
    _used(policy, tree, nodes["c"], 2)
    _used(policy, tree, nodes["a"])
    return tree, nodes


@pytest.mark.parametrize("name,expected", [
    ("slru", "bca"),     # b used once (probation); a and c protected, c's last use before a's
    ("s3fifo", "bca"),   # b in the small FIFO; a and c in main, by recency
    ("tinylfu", "bac"),  # frequencies 1, 2, 3
    ("lfu", "bac"),
    ("arc", "bca"),      # no ghost hits yet: no T2 bonus, plain recency
    ("gdsf", "bac"),     # H = uses x cost per slot at an equal depth, so frequency order
    ("adaptive", "bac"), # no ghost back yet: weight 1, GDSF's order
    ("filo", "cba"),     # newest created first, whatever the uses
])
def test_order_on_three_leaves(name, expected):
    policy = get_policy(name)
    _, nodes = _three(policy)
    assert _order(policy, nodes) == expected


def test_get_policy_gives_a_fresh_instance_each_time():
    assert get_policy("arc") is not get_policy("arc")
    assert set(POLICIES) >= {"lru", "slru", "s3fifo", "arc", "tinylfu", "gdsf", "hitdensity"}


def test_gdsf_prefers_to_keep_deeper_tokens_and_ages_by_its_clock():
    policy = get_policy("gdsf")
    tree = RadixTree()
    shallow = tree.insert(RadixKey([1] * 4), [0] * 4).new_node
    deep_parent = tree.insert(RadixKey([2] * 60000), [0] * 60000).new_node
    deep = tree.insert(RadixKey([2] * 60000 + [5] * 4), [0] * 60004).new_node
    for n in (shallow, deep_parent, deep):
        policy.on_access(n)
    # equal uses: attention after 60k tokens makes the deep leaf's prefill dearer, so it stays longer
    assert _order(policy, {"s": shallow, "d": deep}) == "sd"
    before = policy.clock
    policy.on_evict(shallow, removed=True)
    assert policy.clock > before  # later H values start from the evicted one's


def test_s3fifo_ghost_sends_a_returning_node_to_main():
    policy = get_policy("s3fifo")
    tree = RadixTree()
    nodes = _leaves(tree, [("a", list(range(8))), ("b", list(range(100, 108)))])
    for n in nodes.values():
        policy.on_access(n)
    policy.on_evict(nodes["a"], removed=True)
    tree.clear_device_value(nodes["a"])
    tree.remove_leaf(nodes["a"])
    again = tree.insert(RadixKey(list(range(10))), [0] * 10).new_node  # the same prefix comes back, longer
    policy.on_access(again)
    assert fingerprint(again) == fingerprint(nodes["a"])
    policy.on_insert(again)
    assert _order(policy, {"b": nodes["b"], "a": again}) == "ba"  # b still in the small queue


def test_arc_bonus_grows_on_a_ghost_of_t2_and_shrinks_on_a_ghost_of_t1():
    policy = get_policy("arc")
    tree = RadixTree()
    nodes = _leaves(tree, [("x", [1, 10]), ("y", [2, 20])])
    for name, uses in (("x", 3), ("y", 1)):
        for _ in range(uses):
            policy.on_access(nodes[name])
    for n in nodes.values():
        policy.on_evict(n, removed=True)
        tree.clear_device_value(n)
        tree.remove_leaf(n)
    policy.on_insert(tree.insert(RadixKey([1, 10]), [0, 0]).new_node)
    assert policy.t2_bonus == policy.step_ticks
    policy.on_insert(tree.insert(RadixKey([2, 20]), [0, 0]).new_node)
    assert policy.t2_bonus == 0


def test_tinylfu_remembers_frequency_across_eviction_and_gates_admission():
    policy = get_policy("tinylfu")
    tree = RadixTree()
    node = tree.insert(RadixKey([1, 10]), [0, 0]).new_node
    policy.on_access(node)
    assert not policy.admit(node)  # used once: not worth an L2 copy
    for _ in range(5):
        policy.on_access(node)
    policy.on_evict(node, removed=True)
    tree.clear_device_value(node)
    tree.remove_leaf(node)
    back = tree.insert(RadixKey([1, 10]), [0, 0]).new_node
    policy.on_access(back)
    policy.on_insert(back)
    assert policy.frequency(back) == 1 + 3 and policy.admit(back)


def test_hit_density_learns_that_young_nodes_are_not_reused():
    """Uses arrive only at age ~1000 ticks: a node of that age outranks a fresh one; cold, it is LRU."""
    policy = HitDensity(refresh_events=1)
    tree = RadixTree()
    old, young = (tree.insert(RadixKey([i, 10]), [0, 0]).new_node for i in (1, 2))
    old.last_access_time, young.last_access_time = 1, 1000
    for n in (old, young):
        policy.on_access(n)
    policy.now = 1000
    assert _order(policy, {"o": old, "y": young}) == "oy"  # no data yet: LRU
    for i in range(20):  # twenty nodes, each used again 1000 ticks after its first use
        node = tree.insert(RadixKey([100 + i, 10]), [0, 0]).new_node
        node.last_access_time = 2000 + i
        policy.on_access(node)
        node.last_access_time = 3000 + i
        policy.on_access(node)
    policy.now = 1000 + 1  # the old node is at age 1000, the young one at age 1
    assert _order(policy, {"o": old, "y": young}) == "yo"


# ---- a split keeps the rank: the new top node holds the same tokens' KV and has had the same uses ------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_split_node_keeps_its_rank_in_both_halves(name):
    policy = get_policy(name)
    tree = RadixTree()
    tree.split_hook = policy.on_split
    node = tree.insert(RadixKey(list(range(12))), list(range(12))).new_node
    policy.on_insert(node)
    for _ in range(3):  # three uses, each at a new tick (as match then insert report them)
        tree.match(RadixKey(list(range(12))))
        policy.on_access(node)
    before = policy.key(node)[:-1]  # the last element is the node id, a tie-break
    top = tree.match(RadixKey(list(range(8)) + [99]), touch=False).nodes[-1]  # a partial match splits it
    assert top is node.parent and len(top) == 8 and len(node) == 4
    assert policy.uses(top) == policy.uses(node) == 3
    assert policy.key(top)[:-1] == policy.key(node)[:-1] == before


def test_gdsf_cost_per_slot_is_fixed_once_known_so_a_demoted_tail_ranks_with_its_head():
    """Splitting off a node's tail (page-granular eviction) must not make the tail look more valuable
    than the head that stays: L2 would keep deep pages it cannot load without the head."""
    policy = get_policy("gdsf")
    tree = RadixTree()
    tree.split_hook = policy.on_split
    node = tree.insert(RadixKey(list(range(64))), list(range(64))).new_node
    policy.on_access(node)
    h = policy.h(node)
    top = tree.split(node, 32)
    assert policy.h(top) == policy.h(node) == h


def test_gdsf_cost_per_slot_is_the_inserted_nodes_not_the_shape_it_has_when_first_ranked():
    """A node's cost is fixed at its insert: a tail split off before anything ranked the node (L1
    demoting it page by page) gets the whole node's cost, as one tier ranking the node whole does. It
    used to be fixed at first ranking, from the tail's own middle (deeper, dearer), which made exclusive
    GDSF tiers drift from one tier (below it by 0.005 points on the conversation trace at 4.5M)."""
    policy = get_policy("gdsf")
    policy.element_tokens = 16
    tree = RadixTree()
    tree.split_hook = policy.on_split
    node = tree.insert(RadixKey(list(range(64))), list(range(64))).new_node
    policy.on_access(node)
    policy.on_insert(node)
    whole = 1.0 + 32 * 16 / policy.attention_tokens  # the middle of 64 elements of 16 tokens
    top = tree.split(node, 32)  # before any ranking
    assert policy.cost_per_slot(node) == policy.cost_per_slot(top) == whole


@pytest.mark.parametrize("policy", ["lru", "gdsf", "adaptive"])
def test_exclusive_tiers_hit_as_one_tier_of_the_same_size_request_by_request(policy):
    """Exclusive tiers at equal memory: L1 a ninth, L2 the rest, against one tier of the total (the
    sweep's configurations). Both simulators serve each request of an agent-like trace with the same hit:
    an exclusive LRU or GDSF pair holds what one tier holds. Before GDSF fixed its costs at insert the
    GDSF pair drifted from request 256 on (a cost taken at first ranking). The loss L2's staging removed
    (a load back's first chunk) is rarer: tests/test_sim.py and tests/test_chunked_loads.py set it up."""
    import json

    from tierkv.replay.gen_traces import agent_trace
    from tierkv.replay.sim import PageSim, SimConfig
    from tierkv.replay.trace import parse_lines

    requests = parse_lines(json.dumps(row) for row in agent_trace(600)).requests
    total = 250_000
    l1 = max(total // 9 // 16 * 16, -(-max(r.input_length for r in requests) // 16) * 16)
    one = PageSim(SimConfig(l1_tokens=total, eviction_policy=policy))
    pair = PageSim(SimConfig(l1_tokens=l1, l2_tokens=total - l1, eviction_policy=policy,
                             tier_mode="exclusive", write_threshold=None))
    hits = [(one.serve(r), pair.serve(r)) for r in requests]
    assert sum(h for h, _ in hits) > 0
    assert [i for i, (a, b) in enumerate(hits) if a != b] == []
    assert pair.result.l2_hit_tokens > 0  # the pair did load back from L2


@pytest.mark.parametrize("policy", ["adaptive", "s3fifo", "gdsf"])
def test_exclusive_tiers_hit_as_one_tier_where_a_new_node_ranks_below_l2(policy):
    """A RAG-like trace at 250k tokens: new nodes (used once) rank below every node used twice under
    adaptive's probation and S3-FIFO's small queue, so the node L1 demotes can rank below all of L2. One tier
    drops it; the L1/L2 pair used to keep it (L2 evicted for each demotion in turn, the earlier ones
    protected) and drop an L2 node the next demotion outranked (S3-FIFO served another hit at request
    616, adaptive at 884). L2 now makes room for all of an eviction's demotions at once, ranking them with
    its own, and adaptive's ghosts name a node the same however a tier split it: the same hits."""
    import json

    from tierkv.replay.gen_traces import rag_trace
    from tierkv.replay.sim import PageSim, SimConfig
    from tierkv.replay.trace import parse_lines

    requests = parse_lines(json.dumps(row) for row in rag_trace(6000)).requests
    total = 250_000  # L1 as the sweep sizes it: the whole trace's longest prompt (a ninth is less)
    l1 = max(total // 9 // 16 * 16, min(-(-max(r.input_length for r in requests) // 16) * 16, total // 2))
    requests = requests[:900]
    one = PageSim(SimConfig(l1_tokens=total, eviction_policy=policy))
    pair = PageSim(SimConfig(l1_tokens=l1, l2_tokens=total - l1, eviction_policy=policy,
                             tier_mode="exclusive", write_threshold=None))
    hits = [(one.serve(r), pair.serve(r)) for r in requests]
    assert sum(h for h, _ in hits) > 0 and pair.result.l2_hit_tokens > 0
    assert [i for i, (a, b) in enumerate(hits) if a != b] == []


# ---- the simulator shares the tree and the policies, and matches the replay ---------------------------
@pytest.mark.parametrize("kwargs", [
    dict(l1_tokens=48_000, eviction_policy="lru"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="lru"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="lru", tier_mode="exclusive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="lru", write_policy="write_back"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="gdsf"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="gdsf", tier_mode="exclusive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="tinylfu", tier_mode="exclusive", l2_admission=True),
    # ghosts fingerprint the same tokens in both (a simulator element is a page): exact since then
    dict(l1_tokens=48_000, eviction_policy="s3fifo"),
    dict(l1_tokens=48_000, eviction_policy="arc"),
    dict(l1_tokens=48_000, eviction_policy="hitdensity"),
    dict(l1_tokens=48_000, eviction_policy="adaptive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="adaptive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="adaptive", tier_mode="exclusive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="adaptive", tier_mode="exclusive", load_chunk_tokens=0),
    # HiCache's whole-node eviction
    dict(l1_tokens=48_000, eviction_policy="gdsf", split_victims=False),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="lru", tier_mode="exclusive", split_victims=False),
    # exclusive tiers: nodes L1 demotes are protected in L2 until the eviction's batch copy ends (the
    # simulator let L2 evict them at once: hitdensity was 0.7 % off, s3fifo off by ties); loads in chunks
    # or in one piece
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="s3fifo", tier_mode="exclusive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="hitdensity", tier_mode="exclusive"),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="hitdensity", tier_mode="exclusive", load_chunk_tokens=0),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="gdsf", tier_mode="exclusive", load_chunk_tokens=0),
    dict(l1_tokens=8_000, l2_tokens=40_000, eviction_policy="arc", tier_mode="exclusive", load_chunk_tokens=1024),
])
def test_simulator_matches_the_replay(kwargs):
    requests = load_trace(FIXTURE).requests
    config = ReplayConfig(**kwargs)
    real = replay(requests, config)
    sim = simulate(requests, from_cache_config(config.cache_config(), config.l1_tokens, config.l2_tokens))
    assert sim.hit_tokens == sum(real.tier_hits().values())
    assert sim.written_tokens == real.written_l1_l2_tokens


def _tokens_in_both_tiers(mode: str) -> int:
    """Replay the fixture (KV verified) and return the tokens the cache then holds in both tiers."""
    replayer = TraceReplayer(ReplayConfig(l1_tokens=8_000, l2_tokens=40_000, tier_mode=mode, verify=True))
    try:
        for req in load_trace(FIXTURE).requests:
            replayer.serve(req)
        replayer.cache.flush()
        replayer.cache.check_integrity()
        nodes = replayer.cache.tree.nodes()
        return sum(len(n) for n in nodes if n.device_value is not None and n.host_value is not None)
    finally:
        replayer.finish()


def test_exclusive_tiers_hold_no_token_in_both_tiers():
    """The tiers add up: no token is held in both tiers, not even an L1-resident ancestor of an L2 node
    (write-back copies only the evicted node; a load back frees every loaded node's copy). Hit ratio at
    equal memory is measured on the shared traces (README, "Eviction policies and tiers")."""
    assert _tokens_in_both_tiers("inclusive") > 0
    assert _tokens_in_both_tiers("exclusive") == 0


# ---- exclusive tiers in the real cache ----------------------------------------------------------------
def _cache(**cfg):
    pool = DeviceKVPool(KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32), 16, 1, "cpu")
    return HiRadixCache(pool, CacheConfig(load_back_threshold=0, hicache_ratio=2.0, **cfg))


def _put(cache, tokens):
    slots = cache.alloc_device(len(tokens))
    cache.device_pool.write_tokens(slots, torch.arange(len(tokens) * 8, dtype=torch.float32).view(2, 1, -1, 1, 4))
    cache.insert(RadixKey(tokens), slots)


def test_exclusive_copies_on_eviction_and_frees_l2_on_load_back():
    cache = _cache(tier_mode="exclusive")
    try:
        _put(cache, list(range(10)))
        cache.flush()
        assert cache.host_pool.num_free_slots == cache.host_pool.num_slots  # nothing copied yet
        assert cache.evict(10) == 10  # demote
        assert cache.stats.written_tokens == 10 and cache.host_pool.num_free_slots == cache.host_pool.num_slots - 10
        load = cache.init_load_back(cache.match_prefix(RadixKey(list(range(10)))).last_host_node)
        assert load.pending.wait()
        cache.step()  # the load is acknowledged: promote, the L2 copy is freed
        assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
        assert all(n.host_value is None for n in cache.tree.nodes())
        cache.check_integrity()
    finally:
        cache.close()


def test_exclusive_frees_the_l2_copy_of_a_loaded_parent_whose_child_stays_in_l2():
    """Loading a parent back frees its L2 copy even with an L2-only child: the child loads through it."""
    cache = _cache(tier_mode="exclusive")
    try:
        _put(cache, list(range(4)))
        _put(cache, list(range(8)))  # a child of the first
        cache.evict(8)  # both demoted: L2 holds the chain
        parent = cache.match_prefix(RadixKey(list(range(4)))).last_host_node
        load = cache.init_load_back(parent)  # only the parent comes back
        assert load.pending.wait()
        cache.step()
        assert parent.host_value is None and parent.device_value is not None  # no duplicate left
        assert cache.host_pool.num_free_slots == cache.host_pool.num_slots - 4  # the child's copy only
        cache.check_integrity()
        child = cache.match_prefix(RadixKey(list(range(8))))
        assert child.host_hit_length == 4
        load = cache.init_load_back(child.last_host_node)  # through the L1-resident parent
        assert load.pending.wait() and len(load.device_indices) == 8
        cache.step()
        assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
        cache.check_integrity()
    finally:
        cache.close()


def test_admission_keeps_never_reused_nodes_out_of_l2():
    cache = _cache(tier_mode="exclusive", eviction_policy="tinylfu", l2_admission=True)
    try:
        _put(cache, list(range(6)))  # used once
        _put(cache, list(range(100, 106)))
        _put(cache, list(range(100, 106)))  # used twice
        cache.flush()
        cache.evict(16)
        assert cache.stats.written_tokens == 6
        assert cache.match_prefix(RadixKey(list(range(100, 106)))).host_hit_length == 6
        assert cache.match_prefix(RadixKey(list(range(6)))).host_hit_length == 0
        cache.check_integrity()
    finally:
        cache.close()


def test_bad_tier_mode_and_admission_are_rejected():
    with pytest.raises(ValueError, match="tier_mode"):
        CacheConfig(tier_mode="both")
    with pytest.raises(ValueError, match="l2_admission"):
        CacheConfig(l2_admission="yes")


def test_exclusive_orders_drop_copies_the_other_tier_holds_first():
    policy = get_policy("lru")
    device_order, host_order = tier_orders(policy, "exclusive")
    tree = RadixTree()
    old, recent = (tree.insert(RadixKey([i, 10]), [0, 0]).new_node for i in (1, 2))
    tree.match(RadixKey([2, 10]))
    recent.host_value = [0, 0]  # L2 holds a copy of the more recent one
    assert _order(device_order, {"o": old, "r": recent}) == "ro"  # L1 drops the duplicate first
    assert _order(policy, {"o": old, "r": recent}) == "or"
    assert tier_orders(policy, "inclusive") == (policy, policy)
    old.host_value = [0, 0]
    tree.clear_device_value(old)  # host-only now: L2 keeps it over the duplicate
    assert _order(host_order, {"o": old, "r": recent}) == "ro"
