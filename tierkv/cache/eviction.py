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
        # device slots of demoted nodes L2 evicted before their copy (_demote_exclusive), while it runs
        self._dropped_stand_ins: list[torch.Tensor] | None = None
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
        if self.config.tier_mode == "exclusive":
            return self._demote_exclusive(num_tokens)
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
            batch.evicted.append((node, self._leave_l1(node)))
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

    def _leave_l1(self, node: TreeNode) -> torch.Tensor:
        """Clear ``node``'s device value and return it; the node leaves the cache (with its L2-only
        descendants) when L2 holds no copy either."""
        slots = self.tree.clear_device_value(node)
        removed = node.host_value is None
        if removed:
            self._remove_with_host_subtree(node)
        self.priority.on_evict(node, removed=removed)
        return slots

    def _take_stand_ins(self, host_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Of ``host_values`` leaving L2, keep the real L2 slots; a demotion's stand-in (only while one
        settles) gives its device slots to ``_dropped_stand_ins``, freed after the batch copy."""
        if self._dropped_stand_ins is None:
            return host_values
        real = []
        for value in host_values:
            if _is_stand_in(value):
                self._dropped_stand_ins.append(-1 - value)
            else:
                real.append(value)
        return real

    def _demote_exclusive(self, num_tokens: int) -> int:
        """:meth:`evict` under exclusive tiers: L2 makes room for all of this eviction's demotions at once,
        after them, ranking them with its own nodes, so what leaves the cache is what one tier of the total
        would drop. Evicting L2 for each demotion in turn, the earlier ones protected, kept a demoted node
        ranking below an L2 node that the next demotion then evicted (adaptive's tiers fell 0.23 points
        below one tier of their total). A demoted node first holds a stand-in host value, its device slots
        as ``-1 - slot``: splits cut it as they cut slots, and an L2 eviction of it drops the node from the
        cache. Those still holding one get L2 slots and one batch copy; a node that must stay (its L2-only
        descendants in use) and found no L2 room goes back to L1, and the next pass evicts past it.
        Lock contract: as :meth:`evict`."""
        freed, skip = 0, set()
        while True:
            num_freed, put_back = self._demote_pass(num_tokens - freed, skip)
            freed += num_freed
            if freed >= num_tokens or not put_back:
                return freed
            skip.update(put_back)

    def _demote_pass(self, num_tokens: int, skip: set[int]) -> tuple[int, list[int]]:
        """One pass of :meth:`_demote_exclusive`, passing over the nodes in ``skip`` (ids); returns the
        tokens freed and the ids of the nodes put back into L1."""
        freed, demoted, kept, to_free = 0, [], [], []
        self._dropped_stand_ins = []
        for node in self._device_heap.victims() if num_tokens > 0 else ():
            if id(node) in skip:
                kept.append(node)
                continue
            self._split_victim(node, num_tokens - freed)
            stand_in = node.host_value is None and self.admit(node)
            if stand_in:
                node.host_value = -1 - node.device_value
                demoted.append(node)
            elif node.host_value is None and node.host_ref:
                kept.append(node)  # deleting it would delete L2 pages in use
                continue
            freed += len(node)
            slots = self._leave_l1(node)
            if not stand_in:  # removed, or its L2 copy stays
                to_free.append(slots)
            if freed >= num_tokens:
                break
        put_back, raised = [], None
        try:
            if demoted:
                put_back, raised = self._settle_demotions(demoted, to_free)
                freed -= sum(len(n) for n in put_back)
        finally:
            to_free += self._dropped_stand_ins
            self._dropped_stand_ins = None
        if to_free:  # only now: the batch copy read the demoted nodes' slots
            self.device_pool.free(torch.cat(to_free))
        self.tree.mark_changed("device", kept)  # candidates again at the next call
        self.stats.evicted_device_tokens += freed
        if raised is not None:  # let it through now that no slot is left loose
            raise raised
        return freed, [id(n) for n in put_back]

    def _settle_demotions(self, demoted: list[TreeNode], to_free: list[torch.Tensor]
                          ) -> tuple[list[TreeNode], BaseException | None]:
        """Evict L2 for ``demoted`` (stand-ins in L2 now), copy those L2 kept, and add the device slots to
        free to ``to_free``. Returns the nodes put back into L1 (no L2 copy, after a failed copy or with no
        L2 room left, and L2-only descendants in use) and what the copy raised (an interrupt)."""
        split_hook = self.tree.split_hook

        def on_split(top: TreeNode, bottom: TreeNode) -> None:  # a stand-in cut in two: both halves demoted
            if split_hook is not None:
                split_hook(top, bottom)
            if bottom.host_value is not None and _is_stand_in(bottom.host_value):
                demoted.append(top)

        self.tree.split_hook = on_split
        try:
            shortfall = sum(len(n) for n in demoted) - self.host_room
            if shortfall > 0:
                self.evict_host(shortfall)
        finally:
            self.tree.split_hook = split_hook
        stayed = [n for n in demoted if n.host_value is not None]  # children before parents
        device_slots = [-1 - n.host_value for n in stayed]
        host_slots = [self.host_pool.alloc(len(n)) if len(n) <= self.host_room else None for n in stayed]
        copied = [i for i, slots in enumerate(host_slots) if slots is not None]
        error = raised = None
        if copied:
            for i in copied:
                stayed[i].host_value = host_slots[i]
                self.tree.inc_host_ref(stayed[i])
            try:
                error = self.transfer.write_now(torch.cat([device_slots[i] for i in copied]),
                                                torch.cat([host_slots[i] for i in copied]))
            except BaseException as exc:  # Ctrl-C mid-copy (or bad slots): settled as a failed copy
                error = raised = exc
            for i in copied:
                self.tree.dec_host_ref(stayed[i])
            self.stats.failed_copies += error is not None
        put_back, written = [], []
        for node, device, host in zip(stayed, device_slots, host_slots):
            if host is not None and error is None:
                self.stats.written_tokens += len(node)
                to_free.append(device)
                written.append(node)
                continue
            if host is None:
                self.stats.write_skipped_tokens += len(node)
            else:
                self.host_pool.free(host)
            node.host_value = None
            if self._put_back_or_remove(node, device, to_free):
                put_back.append(node)
        for node in written:  # once no stand-in is left on their paths; gone if an ancestor could not stay
            if node.host_value is not None:
                self.backed_up(node)
        return put_back, raised

    def _put_back_or_remove(self, node: TreeNode, device_slots: torch.Tensor, to_free: list[torch.Tensor]) -> bool:
        """A demoted node L2 did not take: back into L1 (True) if its L2-only descendants are in use
        (host_ref) or a demoted child went back, else out of the cache."""
        if node.host_ref or any(c.device_value is not None for c in node.children.values()):
            self.tree.set_device_value(node, device_slots)
            return True
        to_free.append(device_slots)
        self._remove_with_host_subtree(node)
        self.priority.on_evict(node, removed=True)
        return False

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
        # a demoted descendant's stand-in (admission refused this node) is no L2 slot
        freed = self._take_stand_ins(drop_host_subtree(self.tree, node, self.priority))
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
        real_slots = self._take_stand_ins(evicted_slots)
        if len(real_slots) != len(evicted_slots):  # a stand-in frees no L2 slot
            freed -= sum(len(v) for v in evicted_slots) - sum(len(v) for v in real_slots)
            evicted_slots = real_slots
        self.host_pool.allocator.free_each(evicted_slots, whole_pages=True)  # no concatenation: see free_each
        self.stats.evicted_host_tokens += freed
        return freed


def _is_stand_in(host_value: torch.Tensor) -> bool:
    """A demoted node's stand-in host value (its device slots as ``-1 - slot``, see
    :meth:`Eviction._demote_exclusive`), not L2 slots."""
    return int(host_value[0]) < 0
