"""Tier bookkeeping for exclusive tiers that needs only the tree (no pools, no I/O)."""

from __future__ import annotations

from typing import Any

from tierkv.radix import RadixTree, TreeNode


def promote_loaded(tree: RadixTree, last: TreeNode, num_tokens: int) -> list[Any]:
    """Exclusive tiers: after a load back of ``num_tokens`` ending at ``last``, detach the L2 copies that
    L1 now duplicates and return their host values (slots) for the caller to free.

    Deepest first, stopping at the first node whose L2 copy must stay: one that is protected (host_ref:
    a backup to L3 or another load reads it) or has a child with an L2 copy (L2 holds a rooted subtree).
    Lock contract: takes no lock; touches only host values of nodes that also hold device values.
    """
    freed, node, left = [], last, num_tokens
    while left > 0 and node is not tree.root and node.host_value is not None and node.device_value is not None:
        if node.host_ref or any(c.host_value is not None for c in node.children.values()):
            break
        freed.append(node.host_value)
        node.host_value = None
        left -= len(node)
        node = node.parent
    return freed


class ExclusiveHostOrder:
    """L2 eviction order for exclusive tiers: copies L1 still holds go first (dropping one loses no
    hit, only a later re-copy), then the policy's order. Static when the policy is: a node's device
    value changes only when it is touched by a load, an insert or an L1 eviction."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.static = policy.static

    def __call__(self, node: TreeNode) -> tuple:
        return (node.device_value is None, self.policy(node))
