"""L2 -> L1 loads, a part of :class:`tierkv.cache.hicache.HiRadixCache`: a host-only path loaded back in one
batch (asynchronous, or deferred into the scheduler step's layer-wise batch, :mod:`tierkv.cache.layer_load`)
or, for exclusive tiers short of L2 room, chunk by chunk (:mod:`tierkv.cache.chunked_load`); the waits a
lookup makes for loads still in flight; and the retirement of a finished load.

The cache hands it the tree, its config, the :class:`~tierkv.cache.eviction.Eviction` part (L1 room, the
pools), the transfer controller, the failed loads and the statistics, and a callable that retires finished
loads (a TP agreement only the cache makes).
"""

from __future__ import annotations

from typing import Callable

import torch

from tierkv.cache.chunked_load import ChunkedLoad
from tierkv.cache.config import CacheConfig
from tierkv.cache.eviction import Eviction
from tierkv.cache.failed_loads import FailedLoads
from tierkv.cache.layer_load import DeferredLoads, LayerLoads
from tierkv.cache.records import CacheStats, LoadResult, PendingLoad
from tierkv.copy.transfer import CopyHandle, TransferController
from tierkv.eviction.tiers import promote_loaded
from tierkv.radix import RadixTree, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


def path_indices(nodes: list[TreeNode]) -> torch.Tensor:
    """The device slots of ``nodes`` (each in L1), in order."""
    return torch.cat([n.device_value for n in nodes]) if nodes else _EMPTY


class LoadBack:
    """The cache's L2 -> L1 loads (see the module docstring). Scheduler thread only."""

    def __init__(self, tree: RadixTree, config: CacheConfig, eviction: Eviction, transfer: TransferController | None,
                 failed_loads: FailedLoads, stats: CacheStats, retire_loads: Callable[[], None]) -> None:
        self.tree, self.config, self.eviction, self.transfer = tree, config, eviction, transfer
        self.failed_loads, self.stats, self.retire_loads = failed_loads, stats, retire_loads
        self.deferred = DeferredLoads(transfer)

    def wait_for(self, device_nodes: list[TreeNode]) -> int:
        """Wait for in-flight loads into these nodes (a lookup is about to hand their KV out); how many
        leading nodes hold valid KV. Lock contract: takes none."""
        if self.transfer is None or not device_nodes:
            return len(device_nodes)
        if self.deferred.queued and self.deferred.touches(path_indices(device_nodes)):
            self.deferred.start()  # a caller may read this KV now: start the queued copy and wait
        if not self.transfer.loads:
            return len(device_nodes)
        usable = len(device_nodes)
        for handle, pending in list(self.transfer.loads):
            if handle.done() and handle.error is None:
                continue
            slots = pending.device_slots
            hit = [i for i, n in enumerate(device_nodes) if torch.isin(n.device_value, slots).any()]
            if hit:
                handle.wait_on_current_stream()
                if handle.error is not None:
                    self.failed_loads.mark(pending)
                    usable = min(usable, hit[0])
        return usable

    def load(self, last_node: TreeNode, mem_quota: int | None = None, defer: bool = False) -> LoadResult:
        """See :meth:`HiRadixCache.init_load_back`. Lock contract: loaded nodes stay locked (and protected
        in L2) until the load is retired (:meth:`finish`)."""
        path = self.tree.path_to_root(last_node)
        if any(n.invalid for n in path):  # a failed load's nodes: not reloadable until dropped
            path = path[:next(i for i, n in enumerate(path) if n.invalid)]
            last_node = path[-1] if path else self.tree.root
        host_only = [n for n in path if n.device_value is None]
        device_part = path[: len(path) - len(host_only)]
        last_device = device_part[-1] if device_part else self.tree.root
        num_tokens = sum(len(n) for n in host_only)
        if num_tokens == 0 or self.transfer is None:
            return LoadResult(path_indices(device_part), last_device)
        if num_tokens < self.config.load_back_threshold:
            return LoadResult(path_indices(device_part), last_device)
        # Locked from here to the ack: making room in L1 must not evict the prefix we extend, and the
        # write-backs that eviction may cause must not evict from L2 the nodes we load.
        evictable_before = self.tree.evictable_size
        self.tree.inc_lock_ref(last_node)
        newly_locked = evictable_before - self.tree.evictable_size
        if mem_quota is not None and num_tokens > mem_quota - newly_locked:
            self.tree.dec_lock_ref(last_node)
            return LoadResult(path_indices(device_part), last_device)
        if self._loads_in_chunks(num_tokens):
            return self._load_in_chunks(host_only, last_node, device_part, last_device)
        device_slots = self.eviction.alloc_device(num_tokens)
        if device_slots is None:
            self.tree.dec_lock_ref(last_node)
            return LoadResult(path_indices(device_part), last_device)
        host_slots = torch.cat([n.host_value for n in host_only])
        offset = 0
        for n in host_only:
            self.tree.set_device_value(n, device_slots[offset:offset + len(n)])
            offset += len(n)
        self.tree.inc_host_ref(last_node)
        pending = PendingLoad(last_node, device_slots, handle=None)
        if defer:
            self.deferred.queue(pending, host_slots)
        else:
            pending.handle = self.transfer.load(host_slots, device_slots, pending)
        self.stats.loaded_tokens += num_tokens
        return LoadResult(path_indices(path), last_node, pending, num_tokens)

    def _loads_in_chunks(self, num_tokens: int) -> bool:
        """Exclusive tiers load in chunks (:mod:`tierkv.cache.chunked_load`, synchronously, one chunk or more)
        when L1's demotions for the load would not fit in L2's free room (the staging reserve apart)."""
        if self.config.tier_mode != "exclusive" or not self.config.load_chunk_tokens:
            return False
        if self.transfer.loads:
            self.retire_loads()  # finished loads promoted first: their L2 slots are free room too
        return num_tokens - self.eviction.device_pool.num_free_slots > self.eviction.host_room

    @property
    def _chunk_tokens(self) -> int:
        page = self.config.page_size
        return max(page, self.config.load_chunk_tokens // page * page)

    def _load_in_chunks(self, host_only: list[TreeNode], last_node: TreeNode, device_part: list[TreeNode],
                        last_device: TreeNode) -> LoadResult:
        """Load the host-only path synchronously, chunk by chunk; what loaded is served even if a chunk
        does not load. Lock contract: releases the caller's lock on ``last_node`` (the KV is in L1)."""
        try:
            loaded = ChunkedLoad(self.eviction, self.transfer, host_only, self._chunk_tokens).run()
        finally:
            self.tree.dec_lock_ref(last_node)
        if not loaded:
            return LoadResult(path_indices(device_part), last_device)
        return LoadResult(path_indices(self.tree.path_to_root(loaded[-1])), loaded[-1], None,
                          sum(len(n) for n in loaded))

    def start(self) -> LayerLoads:
        """Start the deferred loads as one layer-wise batch (see HiRadixCache.start_loading). Lock
        contract: takes none (each load holds its own)."""
        if self.transfer is None:
            return LayerLoads()
        return self.deferred.start()

    def finish(self, pending: PendingLoad, handle: CopyHandle) -> None:
        """Retire a finished load. Lock contract: releases its lock and protection on ``pending.node``."""
        self.tree.dec_lock_ref(pending.node)
        self.tree.dec_host_ref(pending.node)
        if handle.error is not None:
            self.stats.failed_copies += 1
            self.failed_loads.mark(pending)
        elif self.config.tier_mode == "exclusive":  # promote: L1 has it now, so L2 need not
            freed = promote_loaded(self.tree, pending.node, len(pending.device_slots))
            if freed:
                self.eviction.host_pool.free(torch.cat(freed))
