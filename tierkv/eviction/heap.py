"""Eviction candidates of one tier kept across calls, so an eviction costs what it evicts.

Rebuilding a heap over the whole leaf frontier on every call costs O(leaves) to free a node or two. Here
one heap per tier lives as long as the tree. The tree records the nodes whose candidacy or key may have
changed since the heap last looked (:meth:`tierkv.radix.RadixTree.changed_nodes`: a value gained or lost,
a child's value lost, an unlock, a touch by match or insert); each call first pushes those that are
candidates now, then pops.

Why the order is the one a fresh heap over the frontier would give: every event that can *lower* a
node's key (a touch, the other tier's copy gained under exclusive tiers) marks the node, so it is
pushed again with its new key; a key that only *rose* (uses counted, priority raised) leaves an entry
that is too small, which is popped early, found stale by recomputing the key, and pushed again (policies
whose keys only touches move, ``keys_rise_untouched`` False, skip that check). An
entry for a node that is not a candidate when popped (locked, not a leaf, gone) is dropped: the event
that makes it one again marks it. Policies whose keys move without any node event (``static`` False:
they age every node at once) keep the old per-call heap over the frontier.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any

from tierkv.eviction.base import Policy, eviction_order
from tierkv.radix_key import load_native

native_evict_device = load_native("evict_device")  # tests set it to None to run the pure-Python loop

# Policy key functions that are (a node slot, node.id): the heap ranks by that slot alone, which orders
# entries (key, node id, seq, node) the same way, and the compiled loop reads it itself instead of
# calling a function. Why: no tuple built per push, one indirection less per heap comparison (tests
# check each against the function).
_SLOT_KEYS = {Policy.key: "last_access_time"}

_COMPACT_SLACK = 1024  # stale entries tolerated beyond twice the live ones before the heap is rebuilt


class EvictionHeap:
    """Candidates of ``tier`` ("device" or "host") of ``tree`` in ``order`` (a policy, or any callable
    with a ``static`` flag). One heap per tier per tree: it consumes the tree's change set."""

    def __init__(self, tree: Any, tier: str, order: Callable[[Any], tuple]) -> None:
        if tier not in ("device", "host"):
            raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")
        self.tree, self.tier, self.order = tree, tier, order
        self._key = _heap_key(order)
        self._is_candidate = tree.is_device_leaf if tier == "device" else tree.is_host_leaf
        self._frontier = tree.device_leaves if tier == "device" else tree.host_leaves
        self._changed: set | None = None
        self._frontiers: Any = None  # the tree's frontiers object that self._changed belongs to
        tree.changed_nodes(tier)  # the tree tracks changes for this tier from now on
        self._heap: list[tuple] = []
        self._live: dict[int, int] = {}  # node id -> sequence number of its one valid entry
        self._seq = itertools.count()

    def victims(self) -> Iterator:
        """Candidates in eviction order. The caller evicts each node yielded before asking for the next
        (its parent may join then); stopping early keeps the rest for the next call."""
        changed = self.tree.changed_nodes(self.tier)
        if changed is not self._changed:  # first call, or the tree was reset: forget the old nodes
            self._changed, self._heap, self._live = changed, [], {}  # (the tree marked all it holds)
        if not getattr(self.order, "static", True):
            changed.clear()  # keys move with time: ranked afresh on every call, as before
            return eviction_order(self._frontier(), self.order, self._next_leaf)
        return self._pop_all()

    def evict_device(self, num_tokens: int, on_evict: Callable[[Any, bool], Any] | None = None,
                     keep_nodes: bool = True) -> tuple[int, list, list]:
        """Evict device candidates in :meth:`victims` order until ``num_tokens`` are freed (none when
        ``num_tokens`` <= 0): each loses its device value and leaves the tree when no tier holds it.
        ``on_evict(node, removed)`` (a policy's hook) runs right after each node is evicted: a policy
        whose state moves on eviction ranks the next candidates by it. Returns (tokens freed, nodes
        evicted, their device values in the same order) for the caller to free the slots; with
        ``keep_nodes`` False the node list is empty and each node removed from the tree is released as
        soon as it is unlinked, while its memory is still in cache (held until the caller drops the list,
        they were all missed a second time: a fifth of a whole-tree eviction). The loop runs in
        tierkv/_radix_evict.c when built (the tree's keys are int64 arrays, the policy static), else in
        Python; both give the same victims.

        Lock contract: locked nodes are never candidates; takes no lock.
        """
        freed, nodes, values, _ = self._evict(num_tokens, on_evict, keep_nodes, 0)
        return freed, nodes, values

    def evict_device_until_held(self, num_tokens: int, on_evict: Callable[[Any, bool], Any] | None,
                                split: bool) -> tuple[int, list, Any]:
        """:meth:`evict_device` (nodes not kept) for a cache with an L2 tier, stopping at the first victim
        the cache must evict itself: one with no L2 copy and L2-only descendants or a host_ref, or (with
        ``split``) one holding more whole pages than still needed. Returns (tokens freed, device values
        to free, that victim or None); the victim is out of the heap, so the caller evicts it, or keeps it
        and marks it changed, and calls again for the rest. Why: the cache's eviction ran a Python loop
        over :meth:`victims` (~3 us a node); this way only the victims that need the cache leave C.

        Lock contract: locked nodes are never candidates; takes no lock.
        """
        freed, _, values, held = self._evict(num_tokens, on_evict, False, 2 if split else 1)
        return freed, values, held

    def evict_host_until_held(self, num_tokens: int, on_evict: Callable[[Any, bool], Any] | None,
                              split: bool) -> tuple[int, list, Any]:
        """:meth:`evict_device_until_held` for the host tier: each victim loses its host slots (returned,
        for the caller to free) and leaves the tree when L1 does not hold it either; with ``split``, a
        victim holding more whole pages than still needed is handed back for the caller to split.

        Lock contract: nodes with a host_ref, and locked host-only nodes, are never candidates.
        """
        if self.tier != "host":
            raise ValueError(f"evict_host_until_held evicts the host tier, this heap ranks {self.tier!r}")
        freed, _, values, held = self._evict(num_tokens, on_evict, False, 2 if split else 0, host=True)
        return freed, values, held

    def _evict(self, num_tokens: int, on_evict: Callable[[Any, bool], Any] | None, keep_nodes: bool,
               hand_back: int, host: bool = False) -> tuple[int, list, list, Any]:
        if self.tier != ("host" if host else "device"):
            raise ValueError(f"evict_device evicts the device tier, this heap ranks {self.tier!r}")
        if num_tokens <= 0:
            return 0, [], [], None
        tree, native = self.tree, native_evict_device
        if native is None or tree.bigram or not getattr(self.order, "static", True):
            return self._evict_device_python(num_tokens, on_evict, keep_nodes, hand_back)
        changed = self._current_changes()
        recheck = getattr(self.order, "keys_rise_untouched", True)
        slot = _SLOT_KEYS.get(type(self.order).key) if isinstance(self.order, Policy) else None
        result = native(tree, self._heap, self._live, changed, self._seq, slot or self._key, recheck, num_tokens,
                        _native_hook(on_evict), keep_nodes, hand_back, host)
        self._compact()
        return result

    def _current_changes(self) -> set:
        """The tree's change set for this tier; as in :meth:`victims`, a new one (first call, or the tree
        was reset) starts the heap over. Why not ``changed_nodes`` on every call: an eviction of a node or
        two spent a tenth of its time looking it up; a reset replaces the tree's frontiers object."""
        frontiers = self.tree.root._frontiers
        if frontiers is self._frontiers and self._changed is not None:
            return self._changed
        changed = self.tree.changed_nodes(self.tier)
        if changed is not self._changed:
            self._changed, self._heap, self._live = changed, [], {}
        self._frontiers = frontiers
        return changed

    def _evict_device_python(self, num_tokens: int, on_evict: Callable[[Any, bool], Any] | None,
                             keep_nodes: bool = True, hand_back: int = 0) -> tuple[int, list, list, Any]:
        """:meth:`_evict` in Python: the reference the compiled loop is tested against."""
        tree, freed, nodes, values = self.tree, 0, [], []
        page, host = tree.page_size, self.tier == "host"
        for node in self.victims():
            if hand_back and not host and node._host_value is None and (node.children or node.host_ref):
                return freed, nodes, values, node
            if hand_back == 2 and len(node.key) > -(-(num_tokens - freed) // page) * page:
                return freed, nodes, values, node
            freed += len(node.key)
            if keep_nodes:
                nodes.append(node)
            if host:
                values.append(node.host_value)
                node.host_value = None
            else:
                values.append(tree.clear_device_value(node))
            removed = node._host_value is None and node._device_value is None and not node.children
            if removed:
                tree.remove_leaf(node)
            if on_evict is not None:
                on_evict(node, removed)
            if freed >= num_tokens:
                break
        return freed, nodes, values, None

    def _next_leaf(self, node: Any) -> Any:
        parent = node.parent
        return parent if parent is not None and self._is_candidate(parent) else None

    def _pop_all(self) -> Iterator:
        heap, live, key_of, is_candidate = self._heap, self._live, self._key, self._is_candidate
        recheck = getattr(self.order, "keys_rise_untouched", True)
        self._drain()
        while heap:
            key, node_id, seq, node = heapq.heappop(heap)
            if live.get(node_id) != seq:
                continue  # superseded by a newer entry
            del live[node_id]
            if not is_candidate(node):
                continue
            if recheck:
                now = key_of(node)
                if now != key:  # the key rose since the push: take its place again
                    self._push(node, now)
                    continue
            yield node
            if self._changed:
                self._drain()

    def _drain(self) -> None:
        changed = self._changed
        if not changed:
            return
        is_candidate, key_of, heap, live, seqs = self._is_candidate, self._key, self._heap, self._live, self._seq
        for node in changed:
            if is_candidate(node):  # _push, inlined: this loop sees every node touched since the last call
                seq = next(seqs)
                live[node.id] = seq
                heapq.heappush(heap, (key_of(node), node.id, seq, node))
        changed.clear()
        self._compact()

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._live) + _COMPACT_SLACK:
            live = self._live
            self._heap[:] = [e for e in self._heap if live.get(e[1]) == e[2]]  # in place: a pop loop holds it
            heapq.heapify(self._heap)

    def _push(self, node: Any, key: tuple) -> None:
        seq = next(self._seq)
        self._live[node.id] = seq
        heapq.heappush(self._heap, (key, node.id, seq, node))


def _native_hook(on_evict: Callable[[Any, bool], Any] | None) -> Any:
    """What the compiled loop calls per evicted node: ``on_evict``, or for the base Policy's own hook
    (LRU's: it only forgets a removed node's uses) that dict, which the loop updates itself (a Python
    call per node was a third of a chat eviction)."""
    if getattr(on_evict, "__func__", None) is Policy.on_evict and type(on_evict.__self__._uses) is dict:
        return on_evict.__self__._uses
    return on_evict


def _heap_key(order: Callable[[Any], tuple]) -> Callable[[Any], Any]:
    """What the heap ranks ``order``'s nodes by: the slot of :data:`_SLOT_KEYS`, or the policy's key
    (one call less per node ranked than calling the policy)."""
    if not isinstance(order, Policy):
        return order
    slot = _SLOT_KEYS.get(type(order).key)
    return operator.attrgetter(slot) if slot is not None else order.key
