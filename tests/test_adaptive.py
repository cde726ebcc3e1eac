"""The adaptive policy (tierkv/eviction/adaptive.py): its order on small trees, what it learns on workloads
where one of its two experts (GDSF, probation) clearly wins, and its bounded bookkeeping. The shared
policy suites (tests/test_policies.py, tests/test_eviction.py) run it too."""

import itertools

import pytest

from tierkv.eviction import POLICIES, eviction_order, get_policy
from tierkv.eviction.adaptive import Adaptive
from tierkv.radix import RadixKey, RadixTree
from tierkv.replay.sim import PageSim, SimConfig
from tierkv.replay.trace import BLOCK_TOKENS, TraceRequest


class _Probation(Adaptive):
    """The probation expert alone: a node used once is worth nothing."""

    name = "test-probation"

    def _learn(self) -> None:
        self.new_weight = 0.0


def _requests(prompts: list[list[int]]) -> list[TraceRequest]:
    return [TraceRequest(i, i + 1, i, BLOCK_TOKENS * len(blocks), 1, tuple(blocks)) for i, blocks in enumerate(prompts)]


def _hot_set_among_scans(num_cycles: int = 700, hot: int = 6, scans_per_hot: int = 8) -> list[TraceRequest]:
    """A fixed hot set of prompts, one of them after every ``scans_per_hot`` one-shot prompts: a hot prompt
    comes back after more one-shots than the cache holds, so only a cache that evicts new nodes first keeps
    it (GDSF sees it used once, evicted, used once again: never more valuable than a one-shot)."""
    ids = itertools.count(hot + 1)
    prompts = []
    for cycle in range(num_cycles):
        prompts.append([1 + cycle % hot])
        prompts += [[next(ids)] for _ in range(scans_per_hot)]
    return _requests(prompts)


def _each_used_twice(num_prompts: int = 2000, gap: int = 6) -> list[TraceRequest]:
    """Every prompt used twice, the second time ``gap`` new prompts later, then never again: the nodes to
    keep are the new ones, and probation evicts exactly those."""
    prompts = []
    for i in range(1, num_prompts + 1):
        prompts.append([i])
        if i > gap:
            prompts.append([i - gap])
    return _requests(prompts)


def _run(requests, policy: str, num_blocks: int) -> PageSim:
    sim = PageSim(SimConfig(l1_tokens=num_blocks * BLOCK_TOKENS, eviction_policy=policy))
    for req in requests:
        sim.serve(req)
    return sim


@pytest.fixture
def probation(monkeypatch):
    monkeypatch.setitem(POLICIES, _Probation.name, _Probation)
    return _Probation.name


def test_learns_probation_when_new_nodes_never_come_back_and_hits_as_probation(probation):
    requests = _hot_set_among_scans()
    adaptive, gdsf, expert = (_run(requests, p, 8) for p in ("adaptive", "gdsf", probation))
    assert adaptive.policy.new_weight < 0.01
    new_rate, reused_rate = adaptive.policy.return_rates()
    assert new_rate < reused_rate
    assert expert.result.hit_tokens > gdsf.result.hit_tokens  # the workload separates the experts
    assert adaptive.result.hit_tokens >= expert.result.hit_tokens


def test_stays_gdsf_when_new_nodes_come_back_soon_and_hits_as_gdsf(probation):
    requests = _each_used_twice()
    adaptive, gdsf, expert = (_run(requests, p, 16) for p in ("adaptive", "gdsf", probation))
    assert adaptive.policy.new_weight > 0.9
    assert gdsf.result.hit_tokens > expert.result.hit_tokens  # the workload separates the experts
    # within what learning costs: the weight starts at 1 but the first removals are all new nodes
    assert adaptive.result.hit_tokens >= 0.99 * gdsf.result.hit_tokens


def _tree_with(policy, specs, tree=None):
    """Leaves (name, tokens, uses), each inserted then used ``uses`` times, as the cache reports them."""
    if tree is None:
        tree = RadixTree()
        tree.split_hook = policy.on_split
    nodes = {}
    for name, tokens, uses in specs:
        node = nodes[name] = tree.insert(RadixKey(tokens), list(tokens)).new_node
        policy.on_access(node)
        policy.on_insert(node)
        for _ in range(uses - 1):
            tree.match(RadixKey(tokens))
            policy.on_access(node)
    return tree, nodes


def _order(policy, nodes) -> str:
    names = {n.id: k for k, n in nodes.items()}
    return "".join(names[n.id] for n in eviction_order(list(nodes.values()), policy, lambda n: None))


def test_weight_at_a_nodes_use_decides_if_a_new_node_outranks_an_older_reused_one():
    """r (reused, used twice) at clock 0; the clock then rises by 1.5 (GDSF's aging); n (new) used once. At
    weight 1 (GDSF) n's H = 1.5 + 1 beats r's 0 + 2, so r goes first; at weight 0 (probation) n's H = 1.5,
    so n goes first. A weight change ranks a node only from its next use (keys stay valid in a heap)."""
    for weight, expected in ((1.0, "rn"), (0.0, "nr")):
        policy = Adaptive(attention_tokens=1 << 40)  # cost per slot 1 at every depth: round numbers
        _, nodes = _tree_with(policy, [("r", [1, 2], 2)])
        policy.clock, policy.new_weight = 1.5, weight
        _, more = _tree_with(policy, [("n", [3, 4], 1)])
        nodes.update(more)
        assert policy.h(nodes["r"]) == pytest.approx(2.0) and policy.h(nodes["n"]) == pytest.approx(1.5 + weight)
        assert _order(policy, nodes) == expected
        policy.new_weight = 1.0 - weight  # learned later: no key changes until the nodes are used again
        assert _order(policy, nodes) == expected


def test_a_node_returning_from_its_ghost_is_ranked_as_reused():
    policy = _Probation(attention_tokens=1 << 40)  # the weight stays 0 whatever the ghosts say
    policy.new_weight = 0.0
    tree, nodes = _tree_with(policy, [("a", [1, 2], 1)])
    tree.clear_device_value(nodes["a"])
    tree.remove_leaf(nodes["a"])
    policy.on_evict(nodes["a"], True)
    _, back = _tree_with(policy, [("a", [1, 2], 1), ("b", [3, 4], 1)], tree)
    assert policy.node_class(back["a"]) == 1 and policy.node_class(back["b"]) == 0
    assert _order(policy, back) == "ba"


def test_a_move_between_tiers_teaches_nothing():
    policy = Adaptive()
    _, nodes = _tree_with(policy, [("a", [1, 2], 1)])
    before = (policy.return_rates(), policy.new_weight, policy.clock)
    policy.on_evict(nodes["a"], False)  # L1 dropped it, L2 keeps it
    assert (policy.return_rates(), policy.new_weight, policy.clock) == before
    assert len(policy.ghosts._fps) == 0


def test_bookkeeping_is_bounded_by_the_ghosts_and_the_nodes_cached():
    ghost_entries = 64
    policy = Adaptive(ghost_entries=ghost_entries)
    tree = RadixTree()
    tree.split_hook = policy.on_split
    for i in range(2000):  # one node in the tree at a time, each removed and half of them re-created
        tokens = [i // 2, 7]
        node = tree.insert(RadixKey(tokens), tokens).new_node
        policy.on_access(node)
        policy.on_insert(node)
        tree.clear_device_value(node)
        tree.remove_leaf(node)
        policy.on_evict(node, True)
    assert len(policy.ghosts._fps) <= ghost_entries
    assert policy.returned == set() and policy._uses == {} and policy._base == {} and policy._cost == {}
    assert policy._cached_tokens == 0
    assert 0.0 <= policy.new_weight <= 1.0


def test_registered_under_its_name():
    assert isinstance(get_policy("adaptive"), Adaptive)


def test_a_node_removed_in_two_pieces_teaches_what_it_teaches_removed_whole():
    """Exclusive tiers remove a node in other pieces than one tier of their total (each tier splits its last
    victim where it needs pages): counted per token, with each token one step of the decay, both learn the
    same. Counted per node, or decayed per removal, they drifted apart."""
    learned = []
    for pieces in (False, True):
        policy = Adaptive(half_life_tokens=64)
        tree, nodes = _tree_with(policy, [("a", list(range(100)), 1), ("b", [500, 501], 2)])
        if pieces:
            head = tree.split(nodes["a"], 60)
            for node in (nodes["a"], head):  # the tail first, as an eviction of a leaf takes it
                tree.clear_device_value(node)
                tree.remove_leaf(node)
                policy.on_evict(node, True)
        else:
            tree.clear_device_value(nodes["a"])
            tree.remove_leaf(nodes["a"])
            policy.on_evict(nodes["a"], True)
        learned.append((policy.return_rates(), policy.new_weight, policy._removed_total, policy._cached_tokens))
    (rates_whole, *rest_whole), (rates_pieces, *rest_pieces) = learned
    assert rates_pieces == pytest.approx(rates_whole, rel=1e-12) and rest_pieces == rest_whole
