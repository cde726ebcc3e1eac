"""The policy interface shared by L1 and L2 eviction, the replay and the page-level simulator.

A policy orders eviction candidates (leaves of one tier) by a priority key: the smallest key goes first.
Keys may read only what any node carries (``id``, ``hit_count``, ``last_access_time``, ``creation_time``,
``priority``, ``parent``, ``key`` and ``len(node)``) plus the policy's own state, so the same class runs
on :class:`tierkv.radix.TreeNode` and on the simulator's nodes. Hooks let stateful policies learn what
happened: a node created, a node dropped from a tier. ``admit`` decides whether a node is worth copying
into a lower tier at all (admission: saves write traffic for pages never reused).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator, Protocol


class PolicyNode(Protocol):
    """What a policy may read from a node (TreeNode and the simulator's nodes both have it)."""

    id: int
    hit_count: int
    last_access_time: int
    creation_time: int
    priority: int
    parent: Any
    key: Any

    def __len__(self) -> int: ...


class Policy:
    """Base policy: LRU order, no state, admits nodes used twice. Subclasses override :meth:`key`.

    ``static`` is True when a node's key changes only when the node itself is touched (accessed, hit,
    created): then a caller may keep keys in a persistent heap. Policies whose keys also depend on
    global state that moves (an adaptive target) set it False. ``keys_rise_untouched`` is True when a
    key may also rise with no tree event (uses counted by :meth:`on_access`, ``hit_count``,
    ``priority``): a persistent heap then re-checks a key when it pops it.
    """

    name = "lru"
    static = True
    keys_rise_untouched = True  # subclasses with other keys may read uses; LRU-like ones say False
    element_tokens = 1  # tokens per key element (the page simulator keys by page)
    # attributes holding per-node state keyed by node id (dicts or sets): a split copies it to the new node
    per_node_state: tuple[str, ...] = ("_uses",)
    # False: a cache under write_back reports no use (:meth:`on_access`), as HiCache's hit_count there
    counts_uses_under_write_back = True

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}

    def uses(self, node: PolicyNode) -> int:
        """Requests that used ``node``: counted from :meth:`on_access`, since the cache's ``hit_count``
        follows the seed's rules (only write-through counts; a split copies it to the new parent)."""
        return max(self._uses.get(node.id, 0), node.hit_count)

    def key(self, node: PolicyNode) -> tuple:
        return (node.last_access_time, node.id)

    def __call__(self, node: PolicyNode) -> tuple:
        return self.key(node)

    def on_insert(self, node: PolicyNode) -> None:
        """``node`` was just created by an insert (a new leaf)."""

    def on_access(self, node: PolicyNode) -> None:
        """A request used ``node`` (its ``last_access_time`` is the tick of this use). Subclasses that
        override it call it last, so :meth:`uses` still counts the uses before this one."""
        self._uses[node.id] = self._uses.get(node.id, 0) + 1

    def on_access_all(self, nodes: list[PolicyNode], count_hits: bool = False) -> None:
        """:meth:`on_access` of each of ``nodes`` in order: an insert's whole path in one call (a method call
        per node was a tenth of a chat-shaped insert). ``count_hits``: also add one to each node's
        ``hit_count`` (the seed's write-through counter), in the same loop."""
        if type(self).on_access is not Policy.on_access:
            for node in nodes:
                self.on_access(node)
                if count_hits:
                    node.hit_count += 1
            return
        uses = self._uses
        if count_hits:
            for node in nodes:
                uses[node.id] = uses.get(node.id, 0) + 1
                node.hit_count += 1
        else:
            for node in nodes:
                uses[node.id] = uses.get(node.id, 0) + 1

    def on_split(self, top: PolicyNode, bottom: PolicyNode) -> None:
        """The tree split ``bottom``: ``top`` (new) holds its first tokens and has had the same uses, so it
        gets ``bottom``'s entry in each dict or set named by :attr:`per_node_state`."""
        for name in self.per_node_state:
            state = getattr(self, name)
            if bottom.id not in state:
                continue
            if isinstance(state, dict):
                state[top.id] = state[bottom.id]
            else:
                state.add(top.id)

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        """``node`` left a tier; ``removed`` when it left the tree altogether (no tier holds it).
        Subclasses that override it call it last."""
        if removed:
            self._uses.pop(node.id, None)

    def admit(self, node: PolicyNode) -> bool:
        """Whether ``node`` is worth a copy in a lower tier (L2 backup or demotion), asked only when
        admission is on (``CacheConfig.l2_admission``): by default, once it has been used twice."""
        return self.uses(node) >= 2


def depth_tokens(node: PolicyNode) -> int:
    """Tokens above ``node`` on its path from the root (the prefix its KV was computed after)."""
    depth, parent = 0, node.parent
    while parent is not None:
        depth += len(parent)
        parent = parent.parent
    return depth


def fingerprint(node: PolicyNode, element_tokens: int = 1) -> int:
    """A hint (not an identity) that a re-created node is one seen before: parent id and first 8 tokens
    (first elements covering them: a page simulator's element is a whole page).

    Parents are usually internal nodes that outlive their evicted leaves, so a conversation's next
    turn re-creating the same tail (longer now) under the same parent maps to the same fingerprint.
    """
    parent = node.parent
    return hash((parent.id if parent is not None else 0, tuple(node.key[:-(-8 // element_tokens)])))


def eviction_order(candidates: list, priority: Callable[[Any], tuple],
                   next_candidate: Callable[[Any], Any]) -> Iterator:
    """Yield candidates in priority order; after each yield, ``next_candidate(node)`` may add its parent.

    The caller evicts the yielded node before asking for the next, so the parent check sees the new state.
    """
    heap = [(priority(n), n.id, n) for n in candidates]
    heapq.heapify(heap)
    while heap:
        _, _, node = heapq.heappop(heap)
        yield node
        parent = next_candidate(node)
        if parent is not None:
            heapq.heappush(heap, (priority(parent), parent.id, parent))
