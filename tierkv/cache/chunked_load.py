"""Exclusive tiers: a load back whose L1 demotions would not fit in L2's free room goes in chunks.

Loading pages back from L2 needs room in L1; L1 demotes pages to L2 to make it; and while the loaded
pages still hold their L2 slots, L2 would have to evict as many pages as the load brings back, where
one tier of the same total size evicts nothing to re-touch them. So the load is cut into chunks of
``CacheConfig.load_chunk_tokens``, copied one after another and waited for: as soon as a chunk's KV is
in L1 its L2 slots are freed, and the next chunk's demotions take them. The first chunk's demotions go
to the staging slots L2 keeps free at rest (``CacheConfig.staging_tokens``, one chunk), which its
freed L2 slots then give back: a swap through one chunk of staging, so a load back makes L2 evict
nothing (an exclusive LRU pair then hits exactly as one LRU of the same size). A load of one chunk or
less goes the same way when L2 is full. A node straddling chunks is handed its device slots when its
last chunk lands (its L2 slots, already freed, are dropped then); if the load stops inside it (no room,
a failed copy, an interrupt), the node is split there: the head is loaded, the tail keeps its L2 copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierkv.cache.eviction import Eviction
from tierkv.copy.transfer import TransferController
from tierkv.eviction.tiers import chunk_segments
from tierkv.radix import TreeNode


@dataclass
class _Filling:
    """A node whose head is in L1 (device slots held here, not yet the node's)."""

    node: TreeNode
    free_host: bool  # its L2 slots are freed as they are copied (False: protected, it keeps its copy)
    device_parts: list[torch.Tensor] = field(default_factory=list)
    num_tokens: int = 0


class ChunkedLoad:
    """One synchronous chunked load back of a host-only path. It owns the device slots of the node it
    is filling until the node takes them; :meth:`run` never leaves a slot unowned."""

    def __init__(self, eviction: Eviction, transfer: TransferController, nodes: list[TreeNode],
                 chunk_tokens: int) -> None:
        # eviction: L1 room for each chunk, L2's staging reserve, and the tree, pools and stats it works on
        self.eviction, self.transfer, self.nodes, self.chunk_tokens = eviction, transfer, nodes, chunk_tokens
        self.loaded: list[TreeNode] = []
        self.filling: _Filling | None = None

    def run(self) -> list[TreeNode]:
        """Load chunk after chunk until done or one does not load; returns the nodes loaded (a prefix of
        the path; the last may be the head of a split node). An interrupt during a copy propagates once
        what loaded is settled. Lock contract: the caller holds a lock on the path's last node."""
        try:
            for segments in chunk_segments(self.nodes, self.chunk_tokens):
                if not self._load(segments):
                    break
        finally:
            self._settle()
        return self.loaded

    def _load(self, segments: list[tuple[TreeNode, int, int]]) -> bool:
        """Load one chunk; the demotions that make L1 room for it may take as many staging slots as it
        has tokens, which its own L2 slots, freed once it is in L1, give back."""
        eviction = self.eviction
        num_tokens = sum(end - start for _, start, end in segments)
        eviction.host_reserve_tokens = max(0, eviction.config.staging_tokens - num_tokens)
        try:
            return self._copy(segments, num_tokens)
        finally:
            eviction.restore_host_reserve()

    def _copy(self, segments: list[tuple[TreeNode, int, int]], num_tokens: int) -> bool:
        eviction = self.eviction
        device_slots = eviction.alloc_device(num_tokens)
        if device_slots is None:
            return False
        host_slots = torch.cat([node.host_value[start:end] for node, start, end in segments])
        try:
            error = self.transfer.load_now(host_slots, device_slots)
        except BaseException:
            eviction.device_pool.free(device_slots)
            raise
        if error is not None:
            eviction.stats.failed_copies += 1
            eviction.device_pool.free(device_slots)
            return False
        freed, offset = [], 0
        for node, start, end in segments:
            filling = self.filling if self.filling is not None else _Filling(node, free_host=node.host_ref == 0)
            self.filling = filling
            filling.device_parts.append(device_slots[offset:offset + end - start])
            filling.num_tokens += end - start
            offset += end - start
            if filling.free_host:
                freed.append(node.host_value[start:end])
            if end == len(node):
                self._hand_over(node, filling)
        if freed:  # the next chunk's demotions take these
            eviction.host_pool.free(torch.cat(freed))
        eviction.stats.loaded_tokens += num_tokens
        return True

    def _hand_over(self, node: TreeNode, filling: _Filling) -> None:
        """``node`` (all of it copied) takes its device slots; its freed L2 slots are forgotten."""
        self.eviction.tree.set_device_value(node, torch.cat(filling.device_parts))
        if filling.free_host:
            node.host_value = None
        self.loaded.append(node)
        self.filling = None

    def _settle(self) -> None:
        """The load stopped inside a node: split it where the copied head ends and load the head."""
        filling = self.filling
        if filling is None or filling.num_tokens == 0:
            return
        head = self.eviction.tree.split(filling.node, filling.num_tokens)
        self._hand_over(head, filling)
