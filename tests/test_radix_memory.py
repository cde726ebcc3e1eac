"""A node keeps alive only its own slots and key (plus at most a partial page or an eighth), whatever the
caller passed.

Before: a leaf's device value was a view of the caller's slot tensor, and its key a view of the caller's
prompt array when the leaf was over half of it, so 100 short branches under a 3,000-token prompt each
kept the whole prompt's slots alive (bench/bench_tree_vs_sglang.py --memory measures the effect).
"""

from array import array

import pytest
import torch

from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import DeviceKVPool, KVSpec
from tierkv.pools.allocator import slack_bytes
from tierkv.radix import RadixKey, RadixTree
from tierkv.radix_key import key_slack


def kept_bytes(node) -> tuple[int, int]:
    """Bytes kept alive by ``node``'s device value and key, and the bytes of its own slots and tokens."""
    value, key = node.device_value, node.key
    key_buffer = key.obj if isinstance(key, memoryview) else key
    return (value.untyped_storage().nbytes(), len(key_buffer) * key_buffer.itemsize), (len(value) * 8, len(key) * 8)


def assert_own(tree: RadixTree) -> None:
    for node in tree.nodes():
        (value_bytes, key_bytes), (own_value, own_key) = kept_bytes(node)
        assert value_bytes <= own_value + slack_bytes(own_value), node
        assert key_bytes <= own_key + key_slack(own_key // 8) * 8, node


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("caller_view", [False, True])
def test_branches_under_a_long_prompt_keep_only_their_own_slots_and_key(page_size, caller_view):
    """100 branches of 50 tokens under a 3,000-token prompt, inserted as the replay (prefix slots, then new
    ones, in one tensor) or the scheduler (a view of a longer per-request slot tensor) inserts them."""
    pool = DeviceKVPool(KVSpec(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.uint8), 16_384, page_size, "cpu")
    cache = HiRadixCache(pool, CacheConfig(page_size=page_size, enable_host=False, eviction_policy="lru"))
    prompt = list(range(3000))
    for branch in range(100):
        ids = array("q", prompt + [10_000 + 100 * branch + i for i in range(50)])
        key = RadixKey(ids)
        prefix = cache.match_prefix(key).device_indices
        num_new = -(-(len(ids) - len(prefix)) // page_size) * page_size
        slots = torch.cat([prefix, pool.alloc(num_new + (1024 if caller_view else 0))])
        value = slots[:len(prefix) + num_new] if caller_view else slots
        owned = cache.insert(key, value)
        pool.free(slots[owned:])
        del ids, key, prefix, slots, value  # the caller's arrays: dropped
        assert_own(cache.tree)
    cache.check_integrity()


def test_split_halves_keep_only_their_own_key():
    """A whole prompt's key is kept as a view of the caller's array; split in two, each half keeps its own."""
    tree = RadixTree(slice_value=lambda v, a, b: v[a:b].clone())
    ids = array("q", range(4000))
    tree.insert(RadixKey(ids), torch.arange(4000))
    tree.insert(RadixKey(array("q", list(range(1000)) + [-1] * 10)), torch.arange(1010))
    assert_own(tree)
    tree.check_integrity()


def test_a_node_is_no_larger_for_the_l3_flag_and_its_flags_survive_a_split():
    """``invalid`` and ``in_storage`` share one slot: a slot each made every node 8 bytes larger, and fan-out
    trees (a node every few tokens) went from 0.97x to 1.02x SGLang's memory per cached token."""
    import sys

    from tierkv.radix import TreeNode

    class SixteenSlots:  # what a node held before the L3 flag: 15 fields and ``invalid``
        __slots__ = tuple(f"field_{i}" for i in range(16))

    assert sys.getsizeof(TreeNode([1, 2], None, None, 0)) <= sys.getsizeof(SixteenSlots())
    tree = RadixTree(slice_value=lambda v, a, b: v[a:b].clone())
    tree.insert(RadixKey(array("q", range(8))), torch.arange(8))
    (leaf,) = tree.root.children.values()
    for invalid, in_storage in [(True, False), (False, True), (True, True), (False, False)]:
        leaf.invalid, leaf.in_storage = invalid, in_storage
        assert (leaf.invalid, leaf.in_storage) == (invalid, in_storage)
    leaf.invalid, leaf.in_storage = False, True
    top = tree.split(leaf, 4)
    assert (top.invalid, top.in_storage) == (False, True) == (leaf.invalid, leaf.in_storage)
    leaf.invalid = True
    assert (top.invalid, leaf.invalid, leaf.in_storage) == (False, True, True)
