"""Regression: match must descend past the first level of the tree (it used to restart at the root)."""

import pytest

from tierkv.radix import RadixKey, RadixTree

pytestmark = pytest.mark.usefixtures("tree_impl")  # every test: compiled and pure-Python tree


def test_match_walks_nested_nodes():
    tree = RadixTree()
    tree.insert(RadixKey([1, 2, 3]), [10, 11, 12])
    tree.insert(RadixKey([1, 2, 3, 4, 5]), [10, 11, 12, 13, 14])
    tree.insert(RadixKey([1, 2, 3, 4, 5, 6, 7]), [10, 11, 12, 13, 14, 15, 16])
    path = tree.match(RadixKey([1, 2, 3, 4, 5, 6, 7, 8]))
    assert path.num_tokens == 7 and [len(n) for n in path.nodes] == [3, 2, 2]
    tree.check_integrity()


def test_match_splits_a_nested_node_at_a_partial_hit():
    tree = RadixTree(page_size=2)
    tree.insert(RadixKey([1, 2, 3, 4]), list(range(4)))
    tree.insert(RadixKey([1, 2, 3, 4, 5, 6, 7, 8]), list(range(8)))
    path = tree.match(RadixKey([1, 2, 3, 4, 5, 6, 9, 9]))
    assert path.num_tokens == 6 and [len(n) for n in path.nodes] == [4, 2]
    tree.check_integrity()
