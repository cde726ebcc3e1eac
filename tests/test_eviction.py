"""Eviction policies: the order each one evicts in, and the error for an unknown name."""

import pytest

from tierkv.eviction import POLICIES, eviction_order, get_policy
from tierkv.radix import RadixKey, RadixTree

pytestmark = pytest.mark.usefixtures("tree_impl")  # every test: compiled and pure-Python tree


def _tree_with_leaves():
    """Three leaves: a created first, b second, c third; then a touched, then c hit twice."""
    tree = RadixTree()
    leaves = {}
    for i, name in enumerate("abc"):
        leaves[name] = tree.insert(RadixKey([i + 1, 100]), [0, 0]).new_node
    tree.match(RadixKey([1, 100]))  # a becomes the most recently used
    leaves["c"].hit_count = 2
    leaves["a"].hit_count = 1
    leaves["b"].hit_count = 1
    leaves["b"].priority = 5
    return tree, leaves


def _order(policy: str) -> str:
    tree, leaves = _tree_with_leaves()
    names = {n.id: k for k, n in leaves.items()}
    return "".join(names[n.id] for n in eviction_order(list(leaves.values()), get_policy(policy),
                                                        lambda n: None))


@pytest.mark.parametrize("policy,expected", [
    ("lru", "bca"),      # b, c untouched since creation, a touched last
    ("mru", "acb"),
    ("fifo", "abc"),
    ("lfu", "bac"),      # b and a hit once (b older access), c twice
    ("priority", "cab"), # a and c priority 0 (c accessed earlier), b priority 5
])
def test_policy_order(policy, expected):
    assert _order(policy) == expected


def test_lfu_ties_are_broken_by_recency():
    tree, leaves = _tree_with_leaves()
    leaves["c"].hit_count = 1
    order = list(eviction_order(list(leaves.values()), get_policy("lfu"), lambda n: None))
    assert [n.id for n in order] == [leaves[k].id for k in "bca"]


def test_parents_join_the_order_when_they_become_leaves():
    tree = RadixTree()
    parent = tree.insert(RadixKey([1, 2]), [0, 1]).new_node
    child = tree.insert(RadixKey([1, 2, 3]), [0, 1, 2]).new_node
    other = tree.insert(RadixKey([9]), [5]).new_node
    tree.match(RadixKey([9]))  # other is most recent, yet the parent follows its child
    seen = []

    def next_candidate(node):
        seen.append(node)
        tree.clear_device_value(node)
        p = node.parent
        return p if tree.is_device_leaf(p) else None

    order = list(eviction_order(tree.device_leaves(), get_policy("lru"), next_candidate))
    assert [n.id for n in order] == [child.id, parent.id, other.id]


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_policy("random")
    message = str(err.value)
    assert "'random'" in message
    for name in POLICIES:
        assert name in message
    with pytest.raises(ValueError, match="None"):
        get_policy(None)
