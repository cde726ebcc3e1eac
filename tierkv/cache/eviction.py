"""Eviction, a part of :class:`tierkv.cache.hicache.HiRadixCache`: L1 eviction (with write-back or exclusive
demotion to L2), L2 eviction, and the allocations that make room by them (with L2's staging reserve).

The cache owns one :class:`Eviction` and hands it the tree, the pools, the policy, the transfer controller
and the statistics; two callables stand for what only the cache can do: retire finished loads (a TP
agreement) and back a written node up to L3 (the L3 tier comes and goes with ``attach_storage``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierkv.cache.config import CacheConfig
from tierkv.cache.records import CacheStats, _WriteBackBatch
from tierkv.copy.transfer import TransferController
from tierkv.eviction.base import Policy
from tierkv.eviction.heap import EvictionHeap
from tierkv.eviction.tiers import drop_host_subtree, tier_orders
from tierkv.pools.allocator import plain_slot_slices
from tierkv.pools.kv import DeviceKVPool, HostKVPool
from tierkv.radix import RadixTree, TreeNode


class Eviction:
    """evict / evict_host, their write-back helpers and the allocations that call them; see each method's
    lock contract. Scheduler thread only."""

    def __init__(self, tree: RadixTree, config: CacheConfig, priority: Policy, device_pool: DeviceKVPool,
                 host_pool: HostKVPool | None, transfer: TransferController | None, stats: CacheStats,
                 retire_loads: Callable[[], None], backed_up: Callable[[TreeNode], None]) -> None:
        self.tree, self.config, self.priority = tree, config, priority
        self.device_pool, self.host_pool, self.transfer, self.stats = device_pool, host_pool, transfer, stats
        self.retire_loads, self.backed_up = retire_loads, backed_up
        self._writes_on_evict = config.writes_on_evict  # frozen config: read once, not per eviction
        device_order, self._host_order = tier_orders(priority, config.tier_mode)
        self._device_heap = EvictionHeap(tree, "device", device_order)
        # made when L2 first evicts, where there is no L2: a heap has the tree track its tier's changes on
        # every match and insert (a tenth of a chat insert's cost), for nothing without a host tier
        self._host_heap_made: EvictionHeap | None = None
        if host_pool is not None:
            self._host_heap_made = EvictionHeap(tree, "host", self._host_order)
        # L2 slots kept free at rest: the staging of an exclusive chunked load (CacheConfig.staging_tokens);
        # a chunk being loaded lowers it by its size while L1 demotes for it (tierkv.cache.chunked_load)
        self.host_reserve_tokens = config.staging_tokens

    @property
    def _host_heap(self) -> EvictionHeap:
        if self._host_heap_made is None:
            self._host_heap_made = EvictionHeap(self.tree, "host", self._host_order)
        return self._host_heap_made

    def admit(self, node: TreeNode) -> bool:
        """Whether L2 takes ``node`` (``l2_admission``: the policy decides)."""
        return not self.config.l2_admission or self.priority.admit(node)

    # ---- allocation ---------------------------------------------------------------------------
    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """L1 slots, evicting from L1 if needed; None when even that leaves too few. Lock contract: none."""
        slots = self.device_pool.alloc(num_tokens)
        if slots is None:
            if self.config.tier_mode == "exclusive" and self.transfer is not None and self.transfer.loads:
                self.retire_loads()  # promote finished loads first: the demotions take their L2 slots
            self.evict(num_tokens - self.device_pool.num_free_slots)
            slots = self.device_pool.alloc(num_tokens)
        return slots

    @property
    def host_room(self) -> int:
        """L2 slots free beyond the staging reserve."""
        return self.host_pool.num_free_slots - self.host_reserve_tokens

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """L2 slots beyond the reserve, evicting from L2 if needed; None when too few. Lock contract: none."""
        if num_tokens > self.host_room:
            self.evict_host(num_tokens - self.host_room)
            if num_tokens > self.host_room:
                return None
        return self.host_pool.alloc(num_tokens)

    def restore_host_reserve(self) -> None:
        """Staging closed: evict from L2 until the reserve is free again (what a chunk's demotions took
        beyond the L2 slots it freed). Lock contract: as :meth:`evict_host`."""
        self.host_reserve_tokens = self.config.staging_tokens
        if self.host_room < 0:
            self.evict_host(-self.host_room)

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if that many are evictable; returns the number freed (with
        ``split_victims``, the default, the last victim gives only the whole pages still needed).

        Backed-up nodes drop their device slots and stay host-only; others are deleted with their
        host-only descendants (no path to them is left), or under write_back copied to L2 first (the
        node alone, as HiCache does: an ancestor is copied when evicted in turn; one batch copy, waited
        for). Lock contract: skips locked nodes, and nodes without an L2 copy whose host-only
        descendants are protected (host_ref: an L3 backup or prefetch reads them).
        """
        write_back = self._writes_on_evict and self.transfer is not None
        if not write_back:
            return self._evict_dropping(num_tokens)
        freed, batch, kept = 0, _WriteBackBatch(), []
        for node in self._device_heap.victims() if num_tokens > 0 else ():
            self._split_victim(node, num_tokens - freed)
            if write_back and node.host_value is None and self.admit(node):
                self._reserve_write_back(node, batch)
            if node.host_value is None and node.host_ref:
                kept.append(node)  # deleting it would delete L2 pages in use
                continue
            freed += len(node)
            # freed only after the batch copy: a write-back may still read these slots
            batch.evicted.append((node, self.tree.clear_device_value(node)))
            removed = node.host_value is None
            if removed:
                self._remove_with_host_subtree(node)
            self.priority.on_evict(node, removed=removed)
            if freed >= num_tokens:
                break
        freed -= self._finish_write_back(batch)
        evicted_slots = [slots for _, slots in batch.evicted if slots is not None]
        if evicted_slots:
            self.device_pool.free(torch.cat(evicted_slots))
        self.tree.mark_changed("device", kept)  # candidates again at the next call
        self.stats.evicted_device_tokens += freed
        if batch.raised is not None:  # let it through now that no slot is left loose
            raise batch.raised
        return freed

    def _evict_dropping(self, num_tokens: int) -> int:
        """:meth:`evict` when nothing is copied on eviction: the heap's compiled loop evicts every victim
        it can alone, and hands back one at a time those this loop must (split, deleted with L2-only
        descendants, or kept). Same victims, same order as the loop over ``victims()``."""
        freed, slots, kept = 0, [], []
        heap, on_evict, split = self._device_heap, self.priority.on_evict, self.config.split_victims
        while freed < num_tokens:
            num_freed, values, node = heap.evict_device_until_held(num_tokens - freed, on_evict, split)
            freed += num_freed
            slots += values
            if node is None:
                break
            self._split_victim(node, num_tokens - freed)
            if node.host_value is None and node.host_ref:
                kept.append(node)  # deleting it would delete L2 pages in use
                continue
            freed += len(node)
            slots.append(self.tree.clear_device_value(node))
            removed = node.host_value is None
            if removed:
                self._remove_with_host_subtree(node)
            on_evict(node, removed=removed)
        self.device_pool.allocator.free_each(slots, whole_pages=True)  # the tree's own, checked at insert
        if kept:
            self.tree.mark_changed("device", kept)  # candidates again at the next call
        self.stats.evicted_device_tokens += freed
        return freed

    def _split_victim(self, node: TreeNode, num_tokens: int) -> None:
        """Cut ``node`` so that it keeps only its last ``num_tokens`` (whole pages) when it holds more: the
        eviction then takes those and the head stays, ranked as before (``split_victims``)."""
        page = self.config.page_size
        num_tokens = -(-num_tokens // page) * page
        if self.config.split_victims and len(node) > num_tokens:
            with plain_slot_slices():
                self.tree.split(node, len(node) - num_tokens)

    def _remove_with_host_subtree(self, node: TreeNode) -> None:
        """Delete ``node`` (in neither tier now) and its L2-only descendants, freeing their host slots."""
        freed = drop_host_subtree(self.tree, node, self.priority)
        if freed:
            self.host_pool.free(torch.cat(freed))
            self.stats.evicted_host_tokens += sum(len(v) for v in freed)
        self.tree.remove_leaf(node)

    def _reserve_write_back(self, node: TreeNode, batch: _WriteBackBatch) -> None:
        """Give ``node`` alone host slots, protected until the batch copy ends: its parent is in L1
        (an L1 victim is a leaf of the device subtree), so its path stays loadable."""
        num_tokens = len(node)
        self.tree.inc_host_ref(node)
        host_slots = self.alloc_host(num_tokens)
        if host_slots is None:
            self.tree.dec_host_ref(node)
            self.stats.write_skipped_tokens += num_tokens
            return
        batch.device_slots.append(node.device_value)
        batch.host_slots.append(host_slots)
        node.host_value = host_slots
        batch.protected.append(node)

    def _finish_write_back(self, batch: _WriteBackBatch) -> int:
        """Copy the batch; on failure drop the copies. Returns the device tokens put back into L1."""
        if not batch.protected:
            return 0
        device_slots = torch.cat(batch.device_slots)
        try:
            error = self.transfer.write_now(device_slots, torch.cat(batch.host_slots))
        except BaseException as exc:  # Ctrl-C mid-copy (or bad slots): settled as a failed copy, raised later
            error = batch.raised = exc
        for n in batch.protected:
            self.tree.dec_host_ref(n)
        if error is None:
            self.stats.written_tokens += len(device_slots)
            for n in batch.protected:
                self.backed_up(n)
            return 0
        self.stats.failed_copies += 1
        self.host_pool.free(torch.cat(batch.host_slots))
        for n in batch.protected:
            n.host_value = None
        restored = 0
        # deepest first, so a node is childless by the time it is removed
        for n in sorted(batch.protected, key=lambda n: -len(self.tree.path_to_root(n))):
            if n.device_value is not None:
                continue  # put back with a deeper node
            if n.host_ref:  # host-only descendants in use (L3 I/O): keep their path in L1
                restored += self._put_back(n, batch)
            else:
                self._remove_with_host_subtree(n)
        return restored

    def _put_back(self, node: TreeNode, batch: _WriteBackBatch) -> int:
        """Give ``node`` and the ancestors evicted with it their device slots back (not freed yet);
        returns their tokens. Each such ancestor was evicted after it, in this same batch."""
        index = {id(n): i for i, (n, _) in enumerate(batch.evicted)}
        restored = 0
        while node is not self.tree.root and node.device_value is None:
            i = index[id(node)]
            self.tree.set_device_value(node, batch.evicted[i][1])
            batch.evicted[i] = (node, None)
            restored += len(node)
            node = node.parent
        return restored

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L2 slots if possible; returns the number freed (``split_victims``:
        the last victim gives only the whole pages still needed).

        Host-only leaves are deleted; L1-resident leaves just drop their backup. Lock contract: skips
        nodes with host_ref (in-flight writes, loads, backups) and locked host-only nodes.
        """
        freed, evicted_slots = 0, []
        heap, on_evict, split = self._host_heap, self.priority.on_evict, self.config.split_victims
        while freed < num_tokens:  # the heap's compiled loop; a victim to split is handed back
            num_freed, values, node = heap.evict_host_until_held(num_tokens - freed, on_evict, split)
            freed += num_freed
            evicted_slots += values
            if node is None:
                break
            self._split_victim(node, num_tokens - freed)
            freed += len(node)
            evicted_slots.append(node.host_value)
            node.host_value = None
            if node.device_value is None:
                self.tree.remove_leaf(node)
            on_evict(node, removed=node.device_value is None)
        self.host_pool.allocator.free_each(evicted_slots, whole_pages=True)  # no concatenation: see free_each
        self.stats.evicted_host_tokens += freed
        return freed
