"""The records the radix tree hands back: a match's path, an insert's plan and its result. Kept apart from
:mod:`tierkv.radix` (structure and operations) so that each module stays one screenful of concerns; the tree
re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierkv.radix_key import RadixKey
from tierkv.radix_walk import Walk

if TYPE_CHECKING:
    from tierkv.radix import TreeNode


@dataclass
class MatchPath:
    """Nodes matched from the root (root excluded), deepest last, and the matched element count."""

    nodes: list[TreeNode]
    num_tokens: int

    @property
    def last_node(self) -> TreeNode | None:
        return self.nodes[-1] if self.nodes else None


@dataclass(slots=True)  # cheaper to make: one per insert
class InsertResult:
    """Where an insert met the existing tree: ``path`` (root side first, the new leaf last), the first
    ``prefix_len`` elements of which the tree held before; ``revived`` the nodes on it that had no device
    value and adopted theirs; ``new_node`` the new leaf."""

    prefix_len: int
    path: list[TreeNode]
    revived: list[TreeNode]
    new_node: TreeNode | None = None

    @property
    def shared(self) -> list[tuple[TreeNode, int, int]]:
        """``(node, start, end)`` for the nodes that already held the device value of ``value[start:end]``
        (derived on demand: the cache never asks, and a list built per insert cost it)."""
        out, pos = [], 0
        for node in self.path:
            if node is self.new_node:
                break
            end = min(pos + len(node.key), self.prefix_len)
            if all(node is not r for r in self.revived):
                out.append((node, pos, end))
            pos = end
        return out


@dataclass(slots=True)  # cheaper to make: one per insert
class InsertPlan:
    """What :meth:`RadixTree.plan_insert` found: the key, its elements (whole pages: ``num_elems``) and the walk."""

    key: RadixKey
    elems: Any
    num_elems: int
    walk: Walk
