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


class ExclusiveOrder:
    """Eviction order of one tier under exclusive tiers: nodes the other tier also holds go first
    (dropping such a copy loses no hit, only a later copy), then the policy's order. Duplicates arise
    because L2 must hold a rooted subtree: demoting a leaf copies its ancestors too.

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
