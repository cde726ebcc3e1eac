"""The radix tree alone: keys, namespaces, page alignment, splits, bigrams, locks and accounting."""

import pytest

from tierkv.radix import RadixKey, RadixTree

pytestmark = pytest.mark.usefixtures("tree_impl")  # every test: compiled and pure-Python tree


def _insert(tree: RadixTree, tokens, extra_key=None, start=1000):
    return tree.insert(RadixKey(tokens, extra_key), list(range(start, start + len(tokens))))


def test_insert_then_match_returns_inserted_values():
    tree = RadixTree()
    _insert(tree, [1, 2, 3, 4])
    path = tree.match(RadixKey([1, 2, 3, 4, 5]))
    assert path.num_tokens == 4
    assert [v for n in path.nodes for v in n.device_value] == [1000, 1001, 1002, 1003]
    tree.check_integrity()


def test_extra_keys_never_share_nodes():
    tree = RadixTree()
    _insert(tree, [1, 2, 3], extra_key="a", start=0)
    _insert(tree, [1, 2, 3], extra_key="b", start=10)
    _insert(tree, [1, 2, 3], start=20)
    assert tree.match(RadixKey([1, 2, 3], "a")).nodes[0].device_value == [0, 1, 2]
    assert tree.match(RadixKey([1, 2, 3], "b")).nodes[0].device_value == [10, 11, 12]
    assert tree.match(RadixKey([1, 2, 3])).nodes[0].device_value == [20, 21, 22]
    assert tree.match(RadixKey([1, 2, 3], "c")).num_tokens == 0
    assert len(list(tree.nodes())) == 3
    tree.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_match_and_insert_are_page_aligned(page_size):
    tree = RadixTree(page_size)
    tokens = list(range(3 * page_size + page_size // 2))
    result = _insert(tree, tokens)
    assert result.new_node is not None and len(result.new_node) == 3 * page_size
    # a query diverging inside the third page matches only two whole pages
    query = tokens[: 2 * page_size] + [-1] * page_size
    assert tree.match(RadixKey(query)).num_tokens == 2 * page_size
    tree.check_integrity()
    for node in tree.nodes():
        assert len(node.key) % page_size == 0


def test_page_size_16_divergence_inside_a_page_splits_at_the_page_start():
    tree = RadixTree(16)
    a = list(range(64))
    b = a[:40] + [999] * 24
    _insert(tree, a, start=0)
    result = _insert(tree, b, start=100)
    assert result.prefix_len == 32  # 40 rounded down to whole pages
    assert sorted(len(n) for n in tree.nodes()) == [32, 32, 32]
    tree.check_integrity()


def test_split_on_partial_match_keeps_values_and_refs():
    tree = RadixTree()
    leaf = _insert(tree, [1, 2, 3, 4, 5, 6], start=0).new_node
    tree.inc_lock_ref(leaf)
    leaf.host_value = list(range(50, 56))
    tree.inc_host_ref(leaf)
    path = tree.match(RadixKey([1, 2, 3, 9]))
    assert path.num_tokens == 3
    top = path.nodes[0]
    assert top.device_value == [0, 1, 2] and leaf.device_value == [3, 4, 5]
    assert top.host_value == [50, 51, 52] and leaf.host_value == [53, 54, 55]
    assert top.lock_ref == leaf.lock_ref == 1 and top.host_ref == leaf.host_ref == 1
    assert leaf.parent is top
    assert tree.protected_size == 6 and tree.evictable_size == 0
    tree.check_integrity()
    tree.dec_lock_ref(leaf)
    tree.dec_host_ref(leaf)
    assert tree.protected_size == 0 and tree.evictable_size == 6
    tree.check_integrity()


def test_split_divides_hash_values_by_page():
    tree = RadixTree(2)
    leaf = _insert(tree, [1, 2, 3, 4, 5, 6], start=0).new_node
    leaf.hash_values = ["h0", "h1", "h2"]
    top = tree.match(RadixKey([1, 2, 3, 4, 7, 8])).nodes[0]
    assert top.hash_values == ["h0", "h1"] and leaf.hash_values == ["h2"]
    tree.check_integrity()


def test_insert_reports_shared_and_new_parts():
    tree = RadixTree()
    _insert(tree, [1, 2, 3], start=0)
    result = _insert(tree, [1, 2, 3, 4, 5], start=10)
    assert result.prefix_len == 3
    assert [(s, e) for _, s, e in result.shared] == [(0, 3)]
    assert result.new_node.device_value == [13, 14]
    assert tree.evictable_size == 5


def test_insert_revives_a_node_without_device_value():
    tree = RadixTree()
    node = _insert(tree, [1, 2, 3], start=0).new_node
    node.host_value = [7, 8, 9]
    tree.clear_device_value(node)
    assert tree.evictable_size == 0
    result = _insert(tree, [1, 2, 3], start=20)
    assert result.revived == [node] and node.device_value == [20, 21, 22]
    assert tree.evictable_size == 3
    tree.check_integrity()


def test_bigram_mode_keys_by_token_pairs():
    tree = RadixTree(bigram=True)
    result = tree.insert(RadixKey([1, 2, 3, 4]), [10, 11, 12])
    assert result.new_node.key == [(1, 2), (2, 3), (3, 4)]
    assert tree.match(RadixKey([1, 2, 3, 5])).num_tokens == 2
    # same tokens as pairs starting elsewhere do not match
    assert tree.match(RadixKey([2, 3, 4])).num_tokens == 0
    tree.check_integrity()


def test_bad_keys_and_page_size_are_rejected():
    with pytest.raises(ValueError, match="0"):
        RadixTree(0)
    tree = RadixTree()
    with pytest.raises(TypeError):
        tree.match([1, 2, 3])
    with pytest.raises(TypeError):
        tree.match(RadixKey([1, "x"]))


def test_lock_ref_moves_tokens_between_evictable_and_protected():
    tree = RadixTree()
    a = _insert(tree, [1, 2, 3, 4]).new_node
    b = _insert(tree, [1, 2, 3, 4, 5, 6]).new_node
    assert (tree.evictable_size, tree.protected_size) == (6, 0)
    tree.inc_lock_ref(b)
    assert (tree.evictable_size, tree.protected_size) == (0, 6)
    tree.inc_lock_ref(a)
    assert a.lock_ref == 2 and b.lock_ref == 1
    tree.dec_lock_ref(b)
    assert (tree.evictable_size, tree.protected_size) == (2, 4)
    tree.dec_lock_ref(a)
    assert (tree.evictable_size, tree.protected_size) == (6, 0)
    with pytest.raises(RuntimeError, match="unlocked"):
        tree.dec_lock_ref(a)
    tree.check_integrity()


def test_locked_node_keeps_its_device_value():
    tree = RadixTree()
    node = _insert(tree, [1, 2]).new_node
    tree.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        tree.clear_device_value(node)
    assert not tree.is_device_leaf(node)
    assert tree.device_leaves() == []


def test_host_ref_protects_host_leaves():
    tree = RadixTree()
    node = _insert(tree, [1, 2]).new_node
    node.host_value = [5, 6]
    assert tree.host_leaves() == [node]
    tree.inc_host_ref(node)
    assert tree.host_leaves() == []
    tree.dec_host_ref(node)
    assert tree.host_leaves() == [node]
    with pytest.raises(RuntimeError, match="unprotected"):
        tree.dec_host_ref(node)


def test_host_only_locked_node_is_not_a_host_leaf():
    tree = RadixTree()
    node = _insert(tree, [1, 2]).new_node
    node.host_value = [5, 6]
    tree.clear_device_value(node)
    tree.inc_lock_ref(node)
    assert tree.host_leaves() == []


def test_device_leaves_are_the_frontier():
    tree = RadixTree()
    _insert(tree, [1, 2, 3])
    leaf = _insert(tree, [1, 2, 3, 4]).new_node
    other = _insert(tree, [1, 2, 5]).new_node
    assert {n.id for n in tree.device_leaves()} == {leaf.id, other.id}


def test_remove_leaf_refuses_nodes_with_values_or_children():
    tree = RadixTree()
    parent = _insert(tree, [1, 2]).new_node
    child = _insert(tree, [1, 2, 3]).new_node
    with pytest.raises(RuntimeError):
        tree.remove_leaf(child)  # still holds a device value
    tree.clear_device_value(child)
    tree.remove_leaf(child)
    tree.clear_device_value(parent)
    tree.remove_leaf(parent)
    assert list(tree.nodes()) == []
    assert tree.evictable_size == 0
    tree.check_integrity()


def test_hit_and_access_times_follow_matches():
    tree = RadixTree()
    node = _insert(tree, [1, 2]).new_node
    before = node.last_access_time
    tree.match(RadixKey([1, 2]))
    assert node.last_access_time > before
    t = node.last_access_time
    tree.match(RadixKey([1, 2]), touch=False)
    assert node.last_access_time == t


def test_check_integrity_allows_an_l2_copy_under_an_l1_only_parent():
    """L2 need not be a rooted subtree: the leaf loads through its parent's L1 KV."""
    tree = RadixTree(2)
    _insert(tree, [1, 2, 3, 4])
    leaf = _insert(tree, [1, 2, 3, 4, 5, 6, 7, 8]).new_node
    leaf.host_value = list(range(len(leaf.key)))
    tree.clear_device_value(leaf)
    assert leaf.parent.host_value is None and leaf.parent.device_value is not None
    tree.check_integrity()


def _broken(tree: RadixTree, how: str) -> None:
    leaf = next(n for n in tree.nodes() if not n.children)
    if how == "value_length":
        leaf.device_value = leaf.device_value[:-1]
    elif how == "accounting":
        tree.evictable_size += 1
    elif how == "child_key":
        parent = leaf.parent
        parent.children[("bogus",)] = parent.children.pop(tree.child_key(leaf.key, leaf.extra_key))
    elif how == "no_value":
        leaf.device_value = None
        tree.evictable_size -= len(leaf.key)
    elif how == "evicted_parent":
        parent = leaf.parent
        tree.evictable_size -= len(parent.device_value)
        parent.device_value = None
        parent.host_value = list(range(len(parent.key)))
    elif how == "lock_below_children":
        leaf.lock_ref = 1
        tree.evictable_size -= len(leaf.key)
        tree.protected_size += len(leaf.key)
    elif how == "page_alignment":
        leaf.key = leaf.key[:-1]
        leaf.device_value = leaf.device_value[:-1]
        tree.evictable_size -= 1
    elif how == "host_child":  # an L2 copy whose parent left both tiers: no path loads it
        parent = leaf.parent
        tree.evictable_size -= len(parent.device_value) + len(leaf.device_value)
        leaf.device_value, parent.device_value = None, None
        leaf.host_value = list(range(len(leaf.key)))
    elif how == "negative_ref":
        leaf.host_ref = -1


@pytest.mark.parametrize("how", ["value_length", "accounting", "child_key", "no_value", "evicted_parent",
                                 "lock_below_children", "page_alignment", "host_child", "negative_ref"])
def test_check_integrity_catches_a_broken_tree(how):
    tree = RadixTree(2)
    _insert(tree, [1, 2, 3, 4])
    _insert(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    tree.check_integrity()
    _broken(tree, how)
    with pytest.raises(AssertionError, match="radix integrity"):
        tree.check_integrity()


def test_reset_empties_the_tree():
    tree = RadixTree()
    _insert(tree, [1, 2, 3])
    tree.reset()
    assert list(tree.nodes()) == [] and tree.evictable_size == 0
    assert tree.match(RadixKey([1, 2, 3])).num_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_walks_every_level(page_size):
    """Regression: match once stopped after the first node below the root."""
    tree = RadixTree(page_size)
    p = page_size
    _insert(tree, list(range(2 * p)), start=0)
    _insert(tree, list(range(4 * p)), start=100)
    _insert(tree, list(range(6 * p)), start=200)
    path = tree.match(RadixKey(list(range(6 * p)) + [-1] * p))
    assert path.num_tokens == 6 * p and len(path.nodes) == 3
    values = [v for n in path.nodes for v in n.device_value]
    assert values == list(range(2 * p)) + list(range(100 + 2 * p, 100 + 4 * p)) + list(
        range(200 + 4 * p, 200 + 6 * p))
    # a partial match two levels down splits the deepest node only
    path = tree.match(RadixKey(list(range(5 * p)) + [-1] * p))
    assert path.num_tokens == 5 * p and len(path.nodes) == 3
    tree.check_integrity()


def test_tensor_token_ids_match_list_token_ids():
    """Regression: 0-d tensor elements hash by identity, so a tensor key never matched."""
    import torch

    tree = RadixTree()
    _insert(tree, [5, 6, 7])
    assert tree.match(RadixKey(torch.tensor([5, 6, 7, 8]))).num_tokens == 3
    with pytest.raises(TypeError):
        tree.match(RadixKey(torch.tensor([5.0, 6.0])))


def test_frontier_tracks_leaves_through_splits_and_removals():
    tree = RadixTree()
    a = _insert(tree, [1, 2, 3, 4]).new_node
    b = _insert(tree, [1, 2, 9]).new_node  # splits a
    assert {n.id for n in tree.device_leaves()} == {a.id, b.id}
    tree.clear_device_value(b)
    tree.remove_leaf(b)
    tree.clear_device_value(a)
    tree.remove_leaf(a)
    (top,) = tree.device_leaves()  # the split-off parent became a leaf
    assert list(top.key) == [1, 2]
    tree.check_integrity()


def test_check_integrity_catches_a_leaf_missing_from_the_frontier():
    tree = RadixTree()
    leaf = _insert(tree, [1, 2]).new_node
    tree.device_leaves()  # the first reader starts the frontier's tracking
    tree.root._frontiers.device.discard(leaf)
    with pytest.raises(AssertionError, match="frontier"):
        tree.check_integrity()


def test_native_and_python_comparisons_agree():
    """The compiled common-prefix length against the reference, at every offset of random keys."""
    import random
    from array import array

    from tierkv import radix

    if radix.native_common_prefix_len is None:
        pytest.skip("tierkv._radix is not built")
    rng = random.Random(0)
    for _ in range(200):
        b = array("q", (rng.randrange(3) for _ in range(rng.randrange(0, 300))))
        offset = rng.randrange(len(b) + 1)
        a = b[offset:offset + rng.randrange(0, 400)]
        if a and rng.random() < 0.7:
            a[rng.randrange(len(a))] += 1
        assert radix.native_common_prefix_len(a, b, offset) == radix._common_prefix_len(a, b, offset)


def test_native_comparison_refuses_what_is_not_an_int64_array():
    from array import array

    from tierkv import radix

    native = radix.native_common_prefix_len
    if native is None:
        pytest.skip("tierkv._radix is not built")
    with pytest.raises(TypeError, match="list"):
        native([1, 2], array("q", [1, 2]), 0)
    with pytest.raises(TypeError, match="array"):
        native(array("i", [1, 2]), array("q", [1, 2]), 0)
    with pytest.raises(ValueError, match="offset 3"):
        native(array("q", [1]), array("q", [1, 2]), 3)


@pytest.mark.parametrize("bigram", [False, True])
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_num_elements_is_the_length_of_the_elements(page_size, bigram):
    tree = RadixTree(page_size, bigram=bigram)
    for n in range(0, 11):
        key = RadixKey(list(range(n)))
        assert tree.num_elements(key) == len(tree.elements(key))


def test_a_partial_last_page_that_matches_a_longer_edge_is_still_cut():
    """The walk reads the key's own array uncut: a tail shorter than a page must never count."""
    tree = RadixTree(4)
    tree.insert(RadixKey(list(range(1, 9))), list(range(8)))
    path = tree.match(RadixKey(list(range(1, 7))))  # 6 ids: one page, then 2 that match the edge
    assert path.num_tokens == 4 and len(path.nodes[-1].key) == 4
    result = tree.insert(RadixKey(list(range(1, 8))), list(range(7)))
    assert result.prefix_len == 4 and result.new_node is None
    tree.check_integrity()


def test_a_long_new_suffix_is_a_view_of_the_callers_array_and_a_short_one_a_copy():
    from array import array

    tree = RadixTree(page_size=2)
    _insert(tree, list(range(10)))
    ids = array("q", range(100))
    long_tail = tree.insert(RadixKey(ids), list(range(100))).new_node
    assert isinstance(long_tail.key, memoryview) and long_tail.key.obj is ids  # not copied
    assert list(long_tail.key) == list(range(10, 100))
    with pytest.raises(BufferError):  # handed over (RadixKey's contract): the tree holds a view of it
        ids.append(1)
    short_tail = tree.insert(RadixKey(array("q", list(range(100)) + [7, 7])), list(range(102))).new_node
    assert type(short_tail.key) is array and list(short_tail.key) == [7, 7]  # a view would pin 102 ids
    path = tree.match(RadixKey(list(range(50)) + [0, 0]))  # splits the view: both halves stay views
    assert path.num_tokens == 50 and list(path.nodes[-1].key) == list(range(10, 50))
    assert [list(n.key) for n in path.nodes[-1].children.values()] == [list(range(50, 100))]
    tree.check_integrity()


# ---- split: an eviction cuts off the tail pages it needs -------------------------------------------
def test_split_cuts_a_node_at_a_page_boundary_and_tells_the_hook():
    tree = RadixTree(page_size=4)
    seen = []
    tree.split_hook = lambda top, bottom: seen.append((len(top), len(bottom)))
    node = tree.insert(RadixKey(list(range(12))), list(range(100, 112))).new_node
    top = tree.split(node, 8)
    assert seen == [(8, 4)]
    assert top.parent is tree.root and node.parent is top
    assert list(top.device_value) == list(range(100, 108)) and list(node.device_value) == [108, 109, 110, 111]
    assert tree.match(RadixKey(list(range(12))), touch=False).num_tokens == 12
    tree.check_integrity()


@pytest.mark.parametrize("num_elements", [0, 12, 16, -4, 6, 4.0, "4"])
def test_split_rejects_a_bad_cut_and_leaves_the_tree_unchanged(num_elements):
    tree = RadixTree(page_size=4)
    node = tree.insert(RadixKey(list(range(12))), list(range(12))).new_node
    with pytest.raises(ValueError, match="num_elements"):
        tree.split(node, num_elements)
    assert len(node) == 12 and node.parent is tree.root
    tree.check_integrity()


def test_split_rejects_the_root():
    tree = RadixTree()
    with pytest.raises(ValueError, match="root"):
        tree.split(tree.root, 1)
