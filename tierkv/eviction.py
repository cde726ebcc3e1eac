"""Eviction policies as priority functions: the node with the smallest priority is evicted first."""

from __future__ import annotations

import heapq
from typing import Callable, Iterator

from tierkv.radix import TreeNode

Priority = Callable[[TreeNode], tuple]

POLICIES: dict[str, Priority] = {
    "lru": lambda n: (n.last_access_time, n.id),
    "lfu": lambda n: (n.hit_count, n.last_access_time, n.id),
    "fifo": lambda n: (n.creation_time, n.id),
    "mru": lambda n: (-n.last_access_time, -n.id),
    # caller-given priority: lower is evicted first; ties go by recency
    "priority": lambda n: (n.priority, n.last_access_time, n.id),
}


def get_policy(name: str) -> Priority:
    """The priority function named ``name``; a ValueError lists the valid names otherwise."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None


def eviction_order(candidates: list[TreeNode], priority: Priority,
                   next_candidate: Callable[[TreeNode], TreeNode | None]) -> Iterator[TreeNode]:
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
