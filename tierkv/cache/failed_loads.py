"""Failed L2 -> L1 loads: their device slots hold garbage, so their nodes must never be matched.

A load that fails leaves its nodes with device slots of no valid KV. Whoever still holds a lock on
them (the load's own ack, a write-through extending them, a caller that ignored ``PendingLoad.wait()``
returning False) may keep them a while, so they cannot be evicted at once. They are marked
``invalid`` as soon as the failure is seen: the cache never matches or loads them, caches nothing
computed below them, and :meth:`FailedLoads.drop_unlocked` evicts them from L1 (their L2 copy is
good) the moment their last lock goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from tierkv.pools.kv import DeviceKVPool
from tierkv.radix import RadixKey, RadixTree, TreeNode

if TYPE_CHECKING:
    from tierkv.cache.records import PendingLoad


class FailedLoads:
    """The failed loads whose invalid nodes are still in ``tree``. Scheduler thread only."""

    def __init__(self, tree: RadixTree, device_pool: DeviceKVPool) -> None:
        self.tree, self.device_pool = tree, device_pool
        self.pending: list["PendingLoad"] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def note(self, loads: Iterable) -> None:
        """Mark the nodes of every load in ``loads`` (ack queue entries: handle, pending) already seen to
        have failed."""
        for handle, pending in loads:
            if handle.error is not None and handle.done():
                self.mark(pending)

    def mark(self, pending: "PendingLoad") -> None:
        """Mark the nodes ``pending`` filled invalid (once)."""
        if pending.failed:
            return
        pending.failed = True
        for n in self.tree.path_to_root(pending.node):  # the loaded nodes, however split since
            if n.device_value is not None and torch.isin(n.device_value, pending.device_slots).all():
                n.invalid = True
        self.pending.append(pending)

    def drop_unlocked(self) -> None:
        """Evict from L1 every invalid node no longer locked, with its L1 descendants (their KV may
        rest on the garbage); nodes with no L2 copy go. Lock contract: locked nodes wait for later."""
        for pending in list(self.pending):
            top = next((n for n in self.tree.path_to_root(pending.node) if n.invalid), None)
            if top is not None and top.lock_ref > 0:
                continue
            self.pending.remove(pending)
            if top is not None:
                self._evict_subtree(top)

    def _evict_subtree(self, top: TreeNode) -> None:
        subtree = [top]
        for n in subtree:  # breadth first: parents before children
            subtree.extend(n.children.values())
        freed = []
        for n in reversed(subtree):
            n.invalid = False
            if n.device_value is not None:
                freed.append(self.tree.clear_device_value(n))
                if n.host_value is None:
                    self.tree.remove_leaf(n)
        if freed:
            self.device_pool.free(torch.cat(freed))

    def cut_key(self, key: RadixKey, device_slots: torch.Tensor) -> tuple[RadixKey, torch.Tensor]:
        """``key`` cut at the end of the first invalid node on its path: KV computed below a failed
        load may rest on its garbage, so none of it is cached (the caller keeps those slots)."""
        path = self.tree.match(key, touch=False)
        bad = next((i for i, n in enumerate(path.nodes) if n.invalid), None)
        if bad is None:
            return key, device_slots
        end = sum(len(n) for n in path.nodes[:bad + 1])
        ids = key.token_ids[: end + (1 if self.tree.bigram else 0)]
        return RadixKey(ids, key.extra_key), device_slots[:end]

    def clear(self) -> None:
        self.pending.clear()

    def check(self) -> None:
        """Every invalid node in the tree still holds its slots and is locked (else it was dropped)."""
        for n in self.tree.nodes():
            if n.invalid and (n.device_value is None or n.lock_ref == 0):
                raise AssertionError(f"invalid node {n.id} not dropped once unlocked")
