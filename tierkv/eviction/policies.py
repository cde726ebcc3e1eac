"""The eviction policies. Each orders leaves by a key (smallest evicted first); see :mod:`.base`.

``self.uses(node)`` counts the requests whose prompt covered a node, ``last_access_time`` and
``creation_time`` are ticks of the tree's logical clock (one per match or insert).
"""

from __future__ import annotations

from collections import OrderedDict

from tierkv.eviction.base import Policy, PolicyNode, depth_tokens, fingerprint


class LRU(Policy):
    """Least recently used first."""

    name = "lru"
    keys_rise_untouched = False  # only touches move it


class MRU(Policy):
    """Most recently used first (loops larger than the cache)."""

    name = "mru"
    keys_rise_untouched = False  # only touches move it

    def key(self, node: PolicyNode) -> tuple:
        return (-node.last_access_time, -node.id)


class FIFO(Policy):
    """Oldest created first."""

    name = "fifo"
    keys_rise_untouched = False  # only touches move it

    def key(self, node: PolicyNode) -> tuple:
        return (node.creation_time, node.id)


class FILO(Policy):
    """Newest created first (HiCache's ``filo``): what was cached longest ago stays."""

    name = "filo"
    keys_rise_untouched = False  # only touches move it

    def key(self, node: PolicyNode) -> tuple:
        return (-node.creation_time, -node.id)


class LFU(Policy):
    """Fewest uses first; ties by recency. Under write_back no use is counted: it is LRU there, as
    HiCache's LFU (whose ``hit_count`` write_back never raises)."""

    name = "lfu"
    counts_uses_under_write_back = False

    def key(self, node: PolicyNode) -> tuple:
        return (self.uses(node), node.last_access_time, node.id)


class CallerPriority(Policy):
    """The caller's ``priority`` (lower evicted first); ties by recency."""

    name = "priority"

    def key(self, node: PolicyNode) -> tuple:
        return (node.priority, node.last_access_time, node.id)


class SLRU(Policy):
    """Segmented LRU (the LRU-2 idea): nodes used once (probation) go before nodes used twice or more
    (protected); LRU within each segment. A scan of one-shot prompts cannot flush reused prefixes.
    Under write_back it is LRU, as :class:`LFU`."""

    name = "slru"
    counts_uses_under_write_back = False

    def key(self, node: PolicyNode) -> tuple:
        return (self.uses(node) >= 2, node.last_access_time, node.id)


class _Ghosts:
    """A bounded set of fingerprints of nodes that left the tree (the ghost lists of ARC / S3-FIFO)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._fps: OrderedDict[int, int] = OrderedDict()

    def add(self, fp: int, value=0):
        """Remember ``fp``; returns the value of the oldest entry it pushed out, or None."""
        self._fps[fp] = value
        self._fps.move_to_end(fp)
        if len(self._fps) > self.capacity:
            return self._fps.popitem(last=False)[1]
        return None

    def pop_older(self, too_old) -> list:
        """Drop and return the values of the oldest entries while ``too_old(value)``."""
        out = []
        while self._fps and too_old(next(iter(self._fps.values()))):
            out.append(self._fps.popitem(last=False)[1])
        return out

    def pop(self, fp: int) -> int | None:
        return self._fps.pop(fp, None)


class S3FIFO(Policy):
    """S3-FIFO on a tree: new nodes sit in a small FIFO queue (evicted first, in creation order); a node
    used again, or re-created while its ghost is remembered, belongs to the main queue (LRU order here)."""

    name = "s3fifo"
    per_node_state = Policy.per_node_state + ("returned",)

    def __init__(self, ghost_entries: int = 1 << 16) -> None:
        super().__init__()
        self.ghosts = _Ghosts(ghost_entries)
        self.returned: set[int] = set()

    def key(self, node: PolicyNode) -> tuple:
        if self.uses(node) < 2 and node.id not in self.returned:
            return (0, node.creation_time, node.id)
        return (1, node.last_access_time, node.id)

    def on_insert(self, node: PolicyNode) -> None:
        if self.ghosts.pop(fingerprint(node, self.element_tokens)) is not None:
            self.returned.add(node.id)

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        if removed:
            self.returned.discard(node.id)
            self.ghosts.add(fingerprint(node, self.element_tokens))
        super().on_evict(node, removed)


class ARC(Policy):
    """Adaptive replacement on a tree: T1 = nodes used once, T2 = used twice or re-created from a ghost.

    Order is recency plus a bonus of ``t2_bonus`` ticks for T2 nodes. The bonus adapts as ARC's target
    does: a ghost of T1 coming back (recency evicted too soon) shrinks it, a ghost of T2 grows it.
    """

    name = "arc"
    per_node_state = Policy.per_node_state + ("returned",)
    static = False  # the bonus moves, so keys of untouched nodes change

    def __init__(self, ghost_entries: int = 1 << 16, step_ticks: int = 16) -> None:
        super().__init__()
        self.ghosts = _Ghosts(ghost_entries)
        self.returned: set[int] = set()
        self.t2_bonus = 0
        self.step_ticks = step_ticks

    def _in_t2(self, node: PolicyNode) -> bool:
        return self.uses(node) >= 2 or node.id in self.returned

    def key(self, node: PolicyNode) -> tuple:
        return (node.last_access_time + (self.t2_bonus if self._in_t2(node) else 0), node.id)

    def on_insert(self, node: PolicyNode) -> None:
        was_t2 = self.ghosts.pop(fingerprint(node, self.element_tokens))
        if was_t2 is None:
            return
        self.returned.add(node.id)
        delta = self.step_ticks if was_t2 else -self.step_ticks
        self.t2_bonus = max(0, self.t2_bonus + delta)

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        if removed:
            self.ghosts.add(fingerprint(node, self.element_tokens), int(self._in_t2(node)))
            self.returned.discard(node.id)
        super().on_evict(node, removed)


class TinyLFU(Policy):
    """TinyLFU-style: a frequency estimate that outlives eviction (a decaying count per fingerprint)
    orders leaves (fewest first, then LRU) and gates admission to lower tiers (estimate >= 2)."""

    name = "tinylfu"
    per_node_state = Policy.per_node_state + ("remembered",)

    def __init__(self, sketch_entries: int = 1 << 16, max_count: int = 15) -> None:
        super().__init__()
        self.history = _Ghosts(sketch_entries)
        self.max_count = max_count
        self.remembered: dict[int, int] = {}

    def frequency(self, node: PolicyNode) -> int:
        return min(self.max_count, self.uses(node) + self.remembered.get(node.id, 0))

    def key(self, node: PolicyNode) -> tuple:
        return (self.frequency(node), node.last_access_time, node.id)

    def on_insert(self, node: PolicyNode) -> None:
        past = self.history.pop(fingerprint(node, self.element_tokens))
        if past:
            self.remembered[node.id] = past // 2  # halved: old popularity decays

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        if removed:
            self.history.add(fingerprint(node, self.element_tokens), self.frequency(node))
            self.remembered.pop(node.id, None)
        super().on_evict(node, removed)

    def admit(self, node: PolicyNode) -> bool:
        return self.frequency(node) >= 2


class GDSF(Policy):
    """Greedy-dual size-frequency: H = L + uses x prefill cost saved per slot; the lowest H goes first
    and L rises to the H of each node that leaves the cache (aging; a move between tiers does not count).
    Cost per token grows with its position, since attention over a longer context costs more:
    ``1 + position / attention_tokens`` (attention_tokens: where attention FLOPs match the linear
    layers', ~32k for an 8B model)."""

    name = "gdsf"
    per_node_state = Policy.per_node_state + ("_base", "_cost")

    def __init__(self, attention_tokens: int = 32768) -> None:
        super().__init__()
        self.attention_tokens = attention_tokens
        self.clock = 0.0
        self._base: dict[int, tuple[int, float]] = {}  # node id -> (access tick, clock at that access)
        self._cost: dict[int, float] = {}  # node id -> prefill cost per slot

    def value_per_slot(self, node: PolicyNode) -> float:
        return self.uses(node) * self.cost_per_slot(node)

    def cost_per_slot(self, node: PolicyNode) -> float:
        """Prefill cost of one of the node's tokens, at its middle position; fixed once known, a split
        sharing it with both halves: what the KV cost to compute does not change when an eviction cuts
        the node (else the tail of a node demoted page by page would rank above its head, and L2 keep
        deep pages it cannot load without the ones it dropped). Known from the node's first use (its
        insert), so it does not depend on when the node is first ranked: exclusive tiers rank nodes at
        other times than one tier does, and split them where L1 demotes, and a cost taken from the shape
        at first ranking made the two drift apart (GDSF tiers lost 0.005 points to one tier)."""
        cost = self._cost.get(node.id)
        if cost is None:
            mid = (depth_tokens(node) + len(node) / 2) * self.element_tokens
            cost = self._cost[node.id] = 1.0 + mid / self.attention_tokens
        return cost

    def on_access(self, node: PolicyNode) -> None:
        self._base[node.id] = (node.last_access_time, self.clock)
        self.cost_per_slot(node)  # fixed now, from the shape the insert gave it
        super().on_access(node)

    def on_insert(self, node: PolicyNode) -> None:
        self.cost_per_slot(node)

    def h(self, node: PolicyNode) -> float:
        tick, base = self._base.get(node.id, (None, 0.0))
        if tick != node.last_access_time:  # touched without a reported use (a match): restart from now
            base = self.clock
            self._base[node.id] = (node.last_access_time, base)
        return base + self.value_per_slot(node)

    def key(self, node: PolicyNode) -> tuple:
        return (self.h(node), node.last_access_time, node.id)

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        if removed:  # a move to another tier is no eviction from the cache: the clock stays
            self.clock = max(self.clock, self.h(node))
            self._base.pop(node.id, None)
            self._cost.pop(node.id, None)
        super().on_evict(node, removed)
