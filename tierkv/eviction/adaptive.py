"""An eviction policy that learns online how much a node used once is worth, between two experts:
GDSF (a new node valued as one use) and an S3-FIFO-like probation (a new node valued as nothing, so it
goes before every node reused, in the order it came).

Why: on the measured traces neither wins everywhere. Probation is best where most new prefixes are
never reused before they would be evicted (the conversation trace at 1M/4.5M tokens, RAG, the synthetic
trace); GDSF is best where the cache is large enough that first-turn prefixes live until their next turn
(conversation at 10M), where probation throws away exactly those.

How it learns (the regret signal of ARC and LeCaR: ghosts of what the cache evicted coming back): a node
leaving the cache leaves a ghost tagged with its class, new (used once, not returning from a ghost) or
reused. Per class it counts removals and ghosts that came back (decayed, so it follows the workload),
and sets the weight of a new node to the ratio of the two classes' return rates, capped at 1:
``new_weight = min(1, p_new / p_reused)``. New nodes evicted that return as often as reused ones mean the
probation was wrong (weight 1: GDSF); new nodes that almost never return mean it was right (weight near
0: probation). A node's value is then ``cost per slot x (uses if reused, else new_weight)``, in GDSF's
greedy-dual form: ``H = L + value``, L the clock at the node's last use.

The weight is captured with the clock at each use, so a node's key changes only when it is used (or its
uses rise): keys stay valid in the cache's persistent heaps (``static``), and a change of weight ranks
nodes as they are next used, not all at once. All learning happens on removals from the cache and on
inserts, never on moves between tiers, so exclusive tiers learn what one tier of their total learns.

Ghosts name what was removed independently of how a tier cut it. A node's identity is the count of its
insert, and a split gives both halves that identity with their offsets in it. A node removed from its start
leaves the ghost (its parent's identity, its first tokens); a piece removed from an offset leaves (its
identity, that offset, its first tokens). Each is the key a node inserted at that point looks up. Before, a
ghost held the parent's node id, and one tier and the L1/L2 pair of its total, which remove the same tokens
in other pieces (each splits where it needs pages), left different ghosts, so later inserts matched
different ones (with the cache's exclusive demotions, 0.02 points below one tier at conversation 10M).
"""

from __future__ import annotations

from tierkv.eviction.base import Policy, PolicyNode
from tierkv.eviction.policies import GDSF, _Ghosts

_NEW, _REUSED = 0, 1


class Adaptive(GDSF):
    name = "adaptive"
    per_node_state = GDSF.per_node_state + ("returned",)

    def __init__(self, attention_tokens: int = 32768, ghost_entries: int = 1 << 16,
                 half_life_tokens: int = 1 << 22, prior_tokens: float = 1024.0, sharpness: float = 3.0) -> None:
        super().__init__(attention_tokens)
        self.ghosts = _Ghosts(ghost_entries)
        self.returned: set[int] = set()  # ids of nodes re-created while their ghost was remembered
        # node id -> (its node's identity, the piece's offset in that node, that node's length in key
        # elements, the node's ghost key); a split gives each half its offset (not a per_node_state copy)
        self._pieces: dict[int, tuple[int, int, int, int]] = {}
        # identities count inserts: the same in one tier and in tiers (node ids count splits too)
        self._inserts = 0
        # (identity, offset) -> ghost key of a removed tail piece, so the piece above it replaces it
        self._tail_ghosts: dict[tuple[int, int], int] = {}
        self.new_weight = 1.0  # GDSF until ghosts say otherwise
        self.sharpness = sharpness  # new_weight = (rate ratio) ** sharpness: how fast it leaves GDSF
        # Everything is counted in tokens, never in nodes: splits cut nodes where each tier needs pages,
        # so node counts differ between exclusive tiers and one tier of their total, token counts do not.
        self._decay_per_token = 0.5 ** (1.0 / half_life_tokens)
        # per class: decayed tokens removed and tokens whose ghost came back, starting at a prior with a
        # return rate of 1/8 for both, so the weight starts at 1 and moves only on evidence
        self._removed_tokens = [prior_tokens, prior_tokens]
        self._returned_tokens = [prior_tokens / 8, prior_tokens / 8]
        self._cached_tokens = 0  # tokens the cache holds (either tier): a cache lifetime's worth of removals
        self._removed_total = 0  # tokens removed so far: a ghost's age in removals

    def node_class(self, node: PolicyNode) -> int:
        return _REUSED if self.uses(node) >= 2 or node.id in self.returned else _NEW

    def value_per_slot(self, node: PolicyNode) -> float:
        _, _, weight = self._stamp(node)
        uses = self.uses(node)
        if uses < 2 and node.id not in self.returned:
            return weight * self.cost_per_slot(node)
        return uses * self.cost_per_slot(node)

    def h(self, node: PolicyNode) -> float:
        return self._stamp(node)[1] + self.value_per_slot(node)

    def _stamp(self, node: PolicyNode) -> tuple[int, float, float]:
        """(tick of the last use, clock then, new-node weight then): restarted from now when the node was
        touched without a reported use (a match), as GDSF's base."""
        stamp = self._base.get(node.id)
        if stamp is None or stamp[0] != node.last_access_time:
            stamp = self._base[node.id] = (node.last_access_time, self.clock, self.new_weight)
        return stamp

    def on_access(self, node: PolicyNode) -> None:
        self._base[node.id] = (node.last_access_time, self.clock, self.new_weight)
        self.cost_per_slot(node)
        Policy.on_access(self, node)

    def _piece(self, node: PolicyNode) -> tuple[int, int, int, int]:
        """(identity, offset, length, ghost key) of ``node``; the root, or a node never seen inserted, is
        whole and named by its id (negative: never an insert's count)."""
        entry = self._pieces.get(node.id)
        if entry is None:
            identity = -node.id if node.parent is not None else 0
            entry = (identity, 0, len(node), hash((identity, self._first(node))))
        return entry

    def _first(self, node: PolicyNode) -> tuple:
        return tuple(node.key[:-(-8 // self.element_tokens)])  # the first elements covering 8 tokens

    def on_split(self, top: PolicyNode, bottom: PolicyNode) -> None:
        super().on_split(top, bottom)
        identity, offset, length, key = self._pieces.get(bottom.id) or (
            -bottom.id, 0, len(top) + len(bottom), hash((-bottom.id, self._first(top))))
        self._pieces[top.id] = (identity, offset, length, key)
        self._pieces[bottom.id] = (identity, offset + len(top), length, key)

    def on_insert(self, node: PolicyNode) -> None:
        super().on_insert(node)
        self._cached_tokens += len(node) * self.element_tokens
        parent_identity, parent_offset, parent_length, _ = self._piece(node.parent)
        first = self._first(node)
        offset = parent_offset + len(node.parent)
        # under a piece that ends where its node does, a child; else the node grows that node's tail again
        # (or forks it where a split left it): the ghost key of what left from there, and its own
        key = hash((parent_identity, first) if offset >= parent_length else (parent_identity, offset, first))
        self._inserts += 1
        self._pieces[node.id] = (self._inserts, 0, len(node), key)
        ghost = self.ghosts.pop(key)
        if ghost is None:
            return
        self.returned.add(node.id)
        cls, removed_at = ghost
        # a ghost back soon after its removal is a hit a slightly larger share would have caught; one back
        # many cache lifetimes later is one no choice between the classes could have kept. Credited with the
        # new node's tokens, not the ghost's: tiers remove a node in other pieces than one tier does.
        lifetimes = (self._removed_total - removed_at) / max(1, self._cached_tokens)
        self._returned_tokens[cls] += len(node) * self.element_tokens * 0.5 ** lifetimes
        self._learn()

    def on_evict(self, node: PolicyNode, removed: bool) -> None:
        if removed:  # a move between tiers teaches nothing: one tier of the total would not see it
            num_tokens = len(node) * self.element_tokens
            cls = self.node_class(node)
            # each token removed is one step of the decay, the node's own tokens too (a geometric sum):
            # a node removed in two pieces, one right after the other, counts as the node removed whole
            decay = self._decay_per_token ** num_tokens
            self._removed_tokens = [t * decay for t in self._removed_tokens]
            self._returned_tokens = [t * decay for t in self._returned_tokens]
            self._removed_tokens[cls] += (1.0 - decay) / (1.0 - self._decay_per_token)
            self._removed_total += num_tokens
            self._cached_tokens = max(0, self._cached_tokens - num_tokens)
            self._add_ghost(node, (cls, self._removed_total))
            self.returned.discard(node.id)
            self._learn()
        super().on_evict(node, removed)

    def return_rates(self) -> tuple[float, float]:
        """Decayed fraction of removed tokens whose ghost came back soon: (new, reused)."""
        return (self._returned_tokens[_NEW] / self._removed_tokens[_NEW],
                self._returned_tokens[_REUSED] / self._removed_tokens[_REUSED])

    def _learn(self) -> None:
        new, reused = self.return_rates()
        # in steps of 1/1024: float sums in another order (a node removed in pieces) give the same weight
        self.new_weight = round(1024 * min(1.0, new / reused) ** self.sharpness) / 1024

    def _add_ghost(self, node: PolicyNode, value: tuple[int, int]) -> None:
        """Remember removed ``node`` as the piece of its node from its offset; the ghost of the tail below
        it (removed before it, a leaf goes first) is replaced: nothing can grow back from there now."""
        identity, offset, length, key = self._pieces.pop(node.id, None) or self._piece(node)
        end = offset + len(node)
        if end < length:
            below = self._tail_ghosts.pop((identity, end), None)
            if below is not None:
                self.ghosts.pop(below)
        if offset == 0:
            self.ghosts.add(key, value)
        else:
            key = self._tail_ghosts[(identity, offset)] = hash((identity, offset, self._first(node)))
            self.ghosts.add(key, value)
