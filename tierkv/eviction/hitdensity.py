"""A workload-aware policy learned online from the trace's reuse gaps: least hit density (after LHD,
Beckmann et al., NSDI'18), on a tree.

Why: in the shared conversation trace a conversation's next turn comes 100-800 requests later and almost
never within 25, so the chance that a node is reused *rises* with its age for a while, then falls. LRU
evicts exactly the nodes about to be reused. This policy measures, per age (ticks since a node's last
use, log-spaced bins) and per class (used once / more), how many uses and how many evictions happen,
and ranks a leaf by its hit density at its current age: expected future uses divided by the expected
slot-time it will still occupy. Lowest density goes first; until data exists every density is 0 and the
order is LRU.

What it learns must not depend on what it evicts (or it only ever sees the gaps it already keeps), so
uses are counted whether the node was still cached or not: an evicted node leaves a ghost (its
fingerprint and last use), and a new node with that fingerprint counts as a use at the ghost's age. A
ghost older than a horizon (``horizon_factor`` times the mean age at eviction, at least
``min_horizon_ticks``) is dropped and counts as a node never used again (a death at its age).
"""

from __future__ import annotations

import math

from tierkv.eviction.base import Policy, PolicyNode, fingerprint
from tierkv.eviction.policies import _Ghosts

_RATIO = 1.25
_NUM_BINS = 72  # ages up to 1.25**72 ~ 9.5e6 ticks


def _bin(age: int) -> int:
    return 0 if age < 1 else min(_NUM_BINS - 1, int(math.log(age) / math.log(_RATIO)) + 1)


_BIN_WIDTH = [max(1.0, _RATIO ** b - (_RATIO ** (b - 1) if b else 0)) for b in range(_NUM_BINS)]


class HitDensity(Policy):
    name = "hitdensity"
    per_node_state = Policy.per_node_state + ("last_use",)
    static = False  # a node's density changes as it ages

    def __init__(self, refresh_events: int = 128, decay: float = 0.98, ghost_entries: int = 1 << 16,
                 horizon_factor: float = 16.0, min_horizon_ticks: int = 1024) -> None:
        super().__init__()
        self.ghosts = _Ghosts(ghost_entries)
        self.horizon_factor, self.min_horizon_ticks = horizon_factor, min_horizon_ticks
        self.mean_eviction_age = 0.0
        self.refresh_events, self.decay = refresh_events, decay
        self.hits = [[0.0] * _NUM_BINS for _ in range(2)]
        self.deaths = [[0.0] * _NUM_BINS for _ in range(2)]
        self.density = [[0.0] * _NUM_BINS for _ in range(2)]
        self.last_use: dict[int, int] = {}
        self.now = 0
        self._events = 0

    def _class(self, node: PolicyNode) -> int:
        return 1 if self.uses(node) >= 2 else 0

    def key(self, node: PolicyNode) -> tuple:
        age = self.now - self.last_use.get(node.id, node.last_access_time)
        return (self.density[self._class(node)][_bin(age)], node.last_access_time, node.id)

    def on_access(self, node: PolicyNode) -> None:
        now = node.last_access_time
        self.now = max(self.now, now)
        prev = self.last_use.get(node.id)
        if prev is not None and now > prev:
            self.hits[self._class(node)][_bin(now - prev)] += 1
            self._event()
        self.last_use[node.id] = now
        super().on_access(node)

    def on_insert(self, node: PolicyNode) -> None:
        ghost = self.ghosts.pop(fingerprint(node, self.element_tokens))
        if ghost is not None:  # a use the cache missed: learn its gap all the same
            last_use, cls = ghost
            self.hits[cls][_bin(node.last_access_time - last_use)] += 1
            self._event()

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        if not removed:
            return  # still cached in another tier: its life goes on
        self._record_removal(node)
        super().on_evict(node, removed)

    def _record_removal(self, node: PolicyNode) -> None:
        prev = self.last_use.pop(node.id, node.last_access_time)
        self.mean_eviction_age += 0.01 * (self.now - prev - self.mean_eviction_age)
        expired = [self.ghosts.add(fingerprint(node, self.element_tokens), (prev, self._class(node)))]
        horizon = max(self.min_horizon_ticks, self.horizon_factor * self.mean_eviction_age)
        expired += self.ghosts.pop_older(lambda ghost: self.now - ghost[0] > horizon)
        for ghost in expired:
            if ghost is not None:
                last_use, cls = ghost
                self.deaths[cls][_bin(self.now - last_use)] += 1
                self._event()

    def _event(self) -> None:
        self._events += 1
        if self._events % self.refresh_events == 0:
            for c in range(2):
                self.density[c] = _densities(self.hits[c], self.deaths[c])
                self.hits[c] = [h * self.decay for h in self.hits[c]]
                self.deaths[c] = [e * self.decay for e in self.deaths[c]]


def _densities(hits: list[float], deaths: list[float]) -> list[float]:
    """Per age bin: uses still to come over slot-time still to spend, for a node that reached that age."""
    out = [0.0] * _NUM_BINS
    future_hits = alive = slot_time = 0.0
    for b in range(_NUM_BINS - 1, -1, -1):
        future_hits += hits[b]
        alive += hits[b] + deaths[b]
        slot_time += alive * _BIN_WIDTH[b]
        out[b] = future_hits / slot_time if slot_time else 0.0
    return out
