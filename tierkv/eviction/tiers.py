"""Tier bookkeeping that needs only the tree (no pools, no I/O), shared by the cache and the simulator.

L2 need not hold a rooted subtree: a node's L2 copy is loadable as long as every ancestor holds its KV
in L1 or L2 (HiCache's write-back copies only the evicted node; an ancestor is copied when L1 evicts it
in turn). So when a node leaves both tiers, its descendants (all L2-only then) lose their path and go too.
"""

from __future__ import annotations

from typing import Any, Iterator

from tierkv.radix import RadixTree, TreeNode


def promote_loaded(tree: RadixTree, last: TreeNode, num_tokens: int) -> list[Any]:
    """Exclusive tiers: after a load back of ``num_tokens`` ending at ``last``, detach the L2 copies that
    L1 now duplicates and return their host values (slots) for the caller to free.

    Every loaded node's copy goes, even one whose children are L2-only (they load through its L1 KV),
    except a protected one (host_ref: a backup to L3 or another load reads it).
    Lock contract: takes no lock; touches only host values of nodes that also hold device values.
    """
    freed, node, left = [], last, num_tokens
    while left > 0 and node is not tree.root and node.device_value is not None:
        if node.host_value is not None and not node.host_ref:
            freed.append(node.host_value)
            node.host_value = None
        left -= len(node)
        node = node.parent
    return freed


def chunk_segments(nodes: list[TreeNode], chunk_elements: int) -> Iterator[list[tuple[TreeNode, int, int]]]:
    """Cut a path of ``nodes`` (root side first) into consecutive chunks of ``chunk_elements`` (the last
    may be shorter), each a list of ``(node, start, end)`` segments; a node may straddle chunks. Exclusive
    tiers load such chunks one after another, so each chunk's freed L2 slots take the pages L1 demotes
    for the next. Lock contract: reads only node lengths."""
    chunk: list[tuple[TreeNode, int, int]] = []
    room = chunk_elements
    for node in nodes:
        start = 0
        while start < len(node):
            end = min(len(node), start + room)
            chunk.append((node, start, end))
            room -= end - start
            start = end
            if room == 0:
                yield chunk
                chunk, room = [], chunk_elements
    if chunk:
        yield chunk


def drop_host_subtree(tree: RadixTree, node: TreeNode, policy) -> list[Any]:
    """Remove ``node``'s descendants, all L2-only, as ``node`` leaves both tiers (they have no path to
    the root any more); returns their host values (slots) for the caller to free. Children before their
    parent, each told to ``policy`` as removed. Lock contract: none of them may be locked or protected
    (``node.host_ref == 0`` and ``node.lock_ref == 0`` ensure it)."""
    freed: list[Any] = []
    stack = [(node, iter(list(node.children.values())))]
    while stack:  # post-order without recursion: a conversation's chain of turns can be deep
        parent, children = stack[-1]
        child = next(children, None)
        if child is not None:
            stack.append((child, iter(list(child.children.values()))))
            continue
        stack.pop()
        if parent is node:
            continue
        freed.append(parent.host_value)
        parent.host_value = None
        tree.remove_leaf(parent)
        policy.on_evict(parent, True)
    return freed


class ExclusiveOrder:
    """Eviction order of one tier under exclusive tiers: nodes the other tier also holds go first
    (dropping such a copy loses no hit, only a later copy), then the policy's order. Duplicates are
    rare: a loaded node whose L2 copy was protected at the load's ack (an L3 backup reading it) keeps it.

    ``other`` is the attribute naming the other tier's value: "host_value" for L1, "device_value" for L2.
    """

    def __init__(self, policy, other: str) -> None:
        self.policy, self.other = policy, other
        self.static, self.keys_rise_untouched = policy.static, policy.keys_rise_untouched

    def __call__(self, node: TreeNode) -> tuple:
        return (getattr(node, self.other) is None, self.policy(node))


def tier_orders(policy, tier_mode: str) -> tuple:
    """The L1 and L2 eviction orders for ``tier_mode``: the policy itself when inclusive."""
    if tier_mode == "exclusive":
        return ExclusiveOrder(policy, "host_value"), ExclusiveOrder(policy, "device_value")
    return policy, policy
