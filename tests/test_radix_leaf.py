"""The compiled new leaf of an insert (tierkv/_radix_leaf.c): the same node, key and child entry as the
Python construction in RadixTree.apply_insert, refusals that change nothing, and no reference leaked."""

from __future__ import annotations

import gc
import itertools
import sys
from array import array

import pytest

from tierkv import radix
from tierkv.radix import RadixKey, RadixTree, TreeNode
from tierkv.radix_key import KEY_SLACK

pytestmark = pytest.mark.skipif(radix.native_new_leaf is None, reason="tierkv._radix is not built")


def _slots(node: TreeNode) -> dict:
    """Every slot of ``node``, keys as bytes plus their type, the parent and frontiers by identity."""
    out = {}
    for name in TreeNode.__slots__:
        value = getattr(node, name)
        if name == "key":
            value = (type(value).__name__, bytes(value))
        elif name in ("parent", "_frontiers"):
            value = id(value)
        elif name == "id":
            continue  # drawn from the one counter: differs by construction
        out[name] = value
    return out


def _twin_trees(page_size: int) -> tuple[RadixTree, RadixTree]:
    native, python = RadixTree(page_size), RadixTree(page_size)
    python._native_leaf = None
    return native, python


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("extra_key", [None, "tenant"])
def test_the_compiled_leaf_is_the_python_leaf(page_size, extra_key):
    """A prompt under a short shared prefix (its new part a view of the prompt) and under a long one (a
    copy), both at page 1 and 16, with and without a namespace: every slot, the key's type and bytes and the
    parent's children entry equal the Python construction's."""
    native, python = _twin_trees(page_size)
    shared = list(range(1000, 1208))  # 13 pages of 16
    prompts = [shared + list(range(5000, 7000)),  # under a short prefix: a view
               shared + list(range(9000, 9000 + 2 * page_size)),  # most of it shared: a copy
               list(range(20000, 20000 + 3 * page_size + page_size // 2))]  # a partial last page
    kinds = set()
    for tokens in prompts:
        leaves = []
        for tree in (native, python):
            result = tree.insert(RadixKey(array("q", tokens), extra_key), list(range(len(tokens))), priority=3)
            leaves.append(result.new_node)
            tree.check_integrity()
        assert _slots(leaves[0]) == _slots(leaves[1]) | {"parent": id(leaves[0].parent),
                                                          "_frontiers": id(native.root._frontiers)}
        assert leaves[0].priority == 3 and leaves[0].children == {} and leaves[0].hash_values is None
        kinds.add(type(leaves[0].key).__name__)
        parents = [leaf.parent for leaf in leaves]
        assert list(parents[0].children) == list(parents[1].children)
        assert parents[0].children[native.child_key(leaves[0].key, extra_key)] is leaves[0]
    assert kinds == {"memoryview", "array"}, "both the view and the copy were made"


def test_a_leaf_keeps_no_more_of_the_prompt_than_its_slack():
    """The view-or-copy rule is RadixTree._leaf_key's: a view leaves out at most KEY_SLACK elements (or
    an eighth of its own), else a copy that keeps nothing of the prompt alive."""
    tree = RadixTree(1)
    tokens = array("q", range(100_000, 100_000 + 2 * KEY_SLACK))
    tree.insert(RadixKey(tokens[:KEY_SLACK + 1]), list(range(KEY_SLACK + 1)))
    within = tree.insert(RadixKey(array("q", tokens[:KEY_SLACK * 2])), list(range(2 * KEY_SLACK))).new_node
    assert type(within.key) is array, "leaving out KEY_SLACK + 1 elements of its prompt: a copy"
    prompt = array("q", range(7, 7 + 4 * KEY_SLACK))
    tree.insert(RadixKey(prompt[:KEY_SLACK]), list(range(KEY_SLACK)))
    view = tree.insert(RadixKey(prompt), list(range(4 * KEY_SLACK))).new_node
    assert type(view.key) is memoryview and view.key.obj is prompt


def test_refusals_change_nothing_and_leak_nothing():
    new_leaf = radix.native_new_leaf
    tree = RadixTree(4)
    elems, value = array("q", range(40)), object()
    ids = itertools.count(10**9)
    before = (sys.getrefcount(elems), sys.getrefcount(value), dict(tree.root.children))
    for start, end in ((0, 6), (2, 10), (0, 44), (-4, 8), (8, 8)):
        with pytest.raises(ValueError, match=f"elements \\[{start}, {end}\\) of 40 are not whole pages of 4"):
            new_leaf(TreeNode, ids, tree.root, elems, start, end, None, 1, 0, value, 4, KEY_SLACK)
    with pytest.raises(TypeError, match="parent must be a TreeNode"):
        new_leaf(TreeNode, ids, object(), elems, 0, 8, None, 1, 0, value, 4, KEY_SLACK)
    with pytest.raises(TypeError, match="elems must be an array"):
        new_leaf(TreeNode, ids, tree.root, array("i", range(8)), 0, 8, None, 1, 0, value, 4, KEY_SLACK)

    class Other:
        __slots__ = ("id", "key")

    with pytest.raises(TypeError, match="__slots__ are not the 16 a tree node has"):
        new_leaf(Other, ids, tree.root, elems, 0, 8, None, 1, 0, value, 4, KEY_SLACK)
    assert (sys.getrefcount(elems), sys.getrefcount(value), dict(tree.root.children)) == before

    leaf = new_leaf(TreeNode, ids, tree.root, elems, 0, 36, None, 1, 0, value, 4, KEY_SLACK)
    assert tree.root.children[elems[:4].tobytes()] is leaf and type(leaf.key) is memoryview
    del tree.root.children[elems[:4].tobytes()], leaf
    gc.collect()
    assert (sys.getrefcount(elems), sys.getrefcount(value), dict(tree.root.children)) == before
