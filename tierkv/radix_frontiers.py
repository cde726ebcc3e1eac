"""The node sets a radix tree keeps so that eviction need not scan it (see :class:`Frontiers`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable


class Frontiers:
    """Per tree: nodes that may be leaves of the device / host subtrees, so eviction need not scan.

    ``device`` and ``host`` are supersets of the leaves: a node is added whenever it may have become a
    leaf (it got a value, or a child lost one) and dropped lazily once seen not to be a leaf any more.
    ``device_changed`` and ``host_changed`` hold the nodes whose eviction candidacy or key may have
    changed since an :class:`tierkv.eviction.heap.EvictionHeap` last drained them: those events plus
    touches, unlocks and (exclusive tiers rank by it) the other tier's value coming or going.
    Each set is None until its first reader asks for it (the tree's ``device_leaves``, ``host_leaves``,
    ``changed_nodes``) and then starts as every node holding a value in its tier. Why: each grows as large
    as the tree, and keeping one that nobody reads (a tree without a host tier, a static policy's device
    frontier) cost a cache miss per node touched, a quarter of a whole-tree eviction.
    """

    __slots__ = ("device", "host", "device_changed", "host_changed")

    def __init__(self) -> None:
        self.device: set | None = None
        self.host: set | None = None
        self.device_changed: set | None = None
        self.host_changed: set | None = None

    def touched(self, nodes: Any) -> None:
        """``nodes`` may rank differently now in both tiers (a touch, an unlock)."""
        if self.device_changed is not None:
            self.device_changed.update(nodes)
        if self.host_changed is not None:
            self.host_changed.update(nodes)

    def touched_path(self, path: list) -> None:
        """The nodes of a match or insert ``path`` (root side first) were touched. For the device tier
        only the deepest holding device slots can be a candidate: each above it has a child (the next on
        the path) holding them, and becomes a candidate, marked as such, only when that child loses them
        (its key then read afresh). Why: an eviction of a cold tree ranked every node ever touched, most
        of them inner nodes of long conversations."""
        if self.device_changed is not None:
            for node in reversed(path):
                if node._device_value is not None:
                    self.device_changed.add(node)
                    break
        if self.host_changed is not None:
            self.host_changed.update(path)

    def leaf_added(self, path: list) -> None:
        """:meth:`value_changed` of a new device leaf (``path[-1]``, unlocked) then :meth:`touched_path` of
        ``path``, in one call: what an insert that adds a leaf does, for a tenth of its cost."""
        leaf = path[-1]
        if self.device is not None:
            self.device.add(leaf)
        changed = self.device_changed
        if changed is not None:
            changed.discard(leaf.parent)  # not a candidate while this child holds slots (see touched_path)
            changed.add(leaf)
        if self.host_changed is not None:
            self.host_changed.update(path)

    def value_changed(self, node: Any, has_value: bool, device: bool) -> None:
        """``node`` got (``has_value``) or lost its value in the device (``device``) or host tier: it, or
        its parent (which may have lost its last child there), may be a leaf there now, and the other tier
        may rank it differently (exclusive tiers do)."""
        frontier, changed, other = ((self.device, self.device_changed, self.host_changed) if device
                                    else (self.host, self.host_changed, self.device_changed))
        if other is not None:
            other.add(node)
        if has_value and device and changed is not None and node.parent is not None:
            changed.discard(node.parent)  # not a candidate while this child holds slots (see touched_path)
        node = node if has_value else node.parent
        if node is not None:
            if frontier is not None:
                frontier.add(node)
            if changed is not None:
                changed.add(node)

    def tracked(self, name: str, nodes: Callable[[], Iterable[Any]]) -> set:
        """The set ``name`` (a slot), tracked from now on; ``nodes()`` lists the tree's nodes, from which
        a set not tracked until now starts: every node holding a value in its tier."""
        if name not in self.__slots__:
            raise ValueError(f"tier must be 'device' or 'host', got {name.rsplit('_changed', 1)[0]!r}")
        tracked = getattr(self, name)
        if tracked is None:
            attr = "_device_value" if name.startswith("device") else "_host_value"
            tracked = {n for n in nodes() if getattr(n, attr) is not None}
            setattr(self, name, tracked)
        return tracked
