"""The hierarchical cache: ties the radix tree, the L1/L2 pools and the transfer controller.

Thread contract: every public method runs on the scheduler thread. Background threads (copies, storage
I/O) never touch the tree; their results arrive through ack queues drained by :meth:`step`.

Tier invariants (checked by :meth:`check_integrity`): nodes holding device slots form a subtree at the
root; every node holds one or both tiers' slots, so every path is loadable (L2 need not hold a rooted
subtree: write-back copies only the evicted node, as HiCache's does, and a node leaving both tiers takes
its L2-only descendants with it). A node's slots in each tier are owned by it alone, and every
allocated slot is owned by a node, an in-flight operation or a caller.
A node whose L1 load failed is ``invalid`` (locked, never matched) until its locks go; then it is dropped.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tierkv.cache.cost_model import CostModel
from tierkv.cache.l3 import StorageController
from tierkv.cache.l3_methods import StorageTierMethods
from tierkv.cache_eviction import EvictionMethods
from tierkv.cache_records import CacheStats, LoadResult, MatchResult, PendingLoad, PendingWrite  # noqa: F401
from tierkv.chunked_load import ChunkedLoad
from tierkv.config import CacheConfig
from tierkv.eviction import get_policy
from tierkv.eviction.heap import EvictionHeap
from tierkv.eviction.tiers import promote_loaded, tier_orders
from tierkv.failed_loads import FailedLoads
from tierkv.layer_load import DeferredLoads, LayerLoads
from tierkv.pools.allocator import plain_slot_slices
from tierkv.pools.kv import DeviceKVPool, HostKVPool, host_pool_tokens
from tierkv.radix import MatchPath, RadixKey, RadixTree, TreeNode
from tierkv.retire import Retirements
from tierkv.tp import TPGroup
from tierkv.transfer import CopyHandle, TransferController, resolve_host_layout

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


class HiRadixCache(StorageTierMethods, EvictionMethods):
    """Prefix cache over L1 (device) and L2 (host) tiers; see the module docstring for contracts.

    The L3 tier's methods (attach_storage, prefetch_from_storage, ...) come from :mod:`tierkv.cache.l3_methods`,
    eviction (evict, evict_host) from :mod:`tierkv.cache_eviction`.
    """

    def __init__(self, device_pool: DeviceKVPool, config: CacheConfig | None = None,
                 host_pool: HostKVPool | None = None, tp: TPGroup | None = None) -> None:
        self.config = config or CacheConfig()
        if device_pool.page_size != self.config.page_size:
            raise ValueError(f"device pool page_size {device_pool.page_size} != config page_size "
                             f"{self.config.page_size}")
        self.device_pool = device_pool
        self.tree = RadixTree(self.config.page_size, bigram=self.config.bigram)
        self.priority = get_policy(self.config.eviction_policy)
        self.tree.split_hook = self.priority.on_split  # a split node's halves keep its rank
        device_order, host_order = tier_orders(self.priority, self.config.tier_mode)
        self._device_heap = EvictionHeap(self.tree, "device", device_order)
        self._host_heap = EvictionHeap(self.tree, "host", host_order)
        self.tp = tp or TPGroup.single()
        self.stats = CacheStats()
        self.host_pool = host_pool
        # L2 slots kept free at rest: the staging of an exclusive chunked load (CacheConfig.staging_tokens);
        # a chunk being loaded lowers it by its size while L1 demotes for it (tierkv.chunked_load)
        self.host_reserve_tokens = self.config.staging_tokens
        self.transfer: TransferController | None = None
        if self.config.enable_host:
            self.host_pool = host_pool or self._make_host_pool()
            self.transfer = TransferController(device_pool, self.host_pool, self.config.io_backend,
                                               self.config.overlap_cpu_writes)
            self.deferred_loads = DeferredLoads(self.transfer)
        self.storage: StorageController | None = None  # the L3 tier: see attach_storage
        self.failed_loads = FailedLoads(self.tree, device_pool)
        # fetch-or-recompute estimates: the engine reports its prefill passes, L3 and loads their timings.
        # Off under TP: decisions from each rank's own timings could differ, and the trees with them
        self.cost_model = CostModel(self.config.prefill_tokens_per_s,
                                    enabled=self.config.cost_aware and self.tp.world_size == 1)

    def _make_host_pool(self) -> HostKVPool:
        cfg, spec = self.config, self.device_pool.spec
        layout = resolve_host_layout(cfg.host_layout, cfg.io_backend)
        tokens = host_pool_tokens(self.device_pool.num_slots, spec.bytes_per_token, cfg.page_size,
                                  cfg.hicache_ratio, cfg.hicache_size_gb, int(cfg.host_memory_reserve_gib * 2**30))
        return HostKVPool(spec, tokens + cfg.staging_tokens, cfg.page_size, layout)

    # ---- lookup ---------------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix of ``key`` in L1 and L2. Lock contract: takes no lock (caller locks).

        ``last_host_node`` is the deepest node of the match, whichever tier holds it: pass it to
        :meth:`init_load_back` (loads its host-only part) and :meth:`prefetch_from_storage` (continues
        from its deepest L2-backed ancestor itself). Unlike HiCache's, it need not be backed up in L2
        (a write_back node in L1 only): engines must not assume ``last_host_node.host_value`` is set.

        Device indices filled by another request's load still in flight are waited for (on CUDA the
        current stream waits on the load's event), so the returned KV is always ready to read.
        """
        path = self.tree.match(key)
        self._note_failed_loads()
        if self.failed_loads:  # nothing from an invalid node on, not even its L2 part: it is loaded
            _cut(path, next((i for i, n in enumerate(path.nodes) if n.invalid), len(path.nodes)))
        device_nodes = []
        for node in path.nodes:
            if node.device_value is None:
                break
            device_nodes.append(node)
        usable = self._wait_for_loads(device_nodes)
        if usable < len(device_nodes):  # a failed load: its nodes are garbage until dropped
            device_nodes = device_nodes[:usable]
            _cut(path, usable)
        last_device = device_nodes[-1] if device_nodes else self.tree.root
        device_hit = sum(len(n) for n in device_nodes)
        host_hit = path.num_tokens - device_hit
        self.stats.device_hit_tokens += device_hit
        self.stats.host_hit_tokens += host_hit
        return MatchResult(self._path_indices(device_nodes), last_device, path.last_node or self.tree.root,
                           host_hit)

    def _wait_for_loads(self, device_nodes: list[TreeNode]) -> int:
        """Wait for in-flight loads into these nodes; how many leading nodes hold valid KV."""
        if self.transfer is None or not device_nodes:
            return len(device_nodes)
        if self.deferred_loads.queued and self.deferred_loads.touches(self._path_indices(device_nodes)):
            self.deferred_loads.start()  # a caller may read this KV now: start the queued copy and wait
        if not self.transfer.loads:
            return len(device_nodes)
        usable = len(device_nodes)
        for item in list(self.transfer.loads):
            if item.handle.done() and item.handle.error is None:
                continue
            slots = item.payload.device_slots
            hit = [i for i, n in enumerate(device_nodes) if torch.isin(n.device_value, slots).any()]
            if hit:
                item.handle.wait_on_current_stream()
                if item.handle.error is not None:
                    self.failed_loads.mark(item.payload)
                    usable = min(usable, hit[0])
        return usable

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock contract: locks ``node``'s path in L1 (never evicted) until :meth:`dec_lock_ref`."""
        self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Lock contract: releases one lock taken by :meth:`inc_lock_ref` on ``node``."""
        self.tree.dec_lock_ref(node)
        if self.failed_loads:
            self.failed_loads.drop_unlocked()

    # ---- insert and write policies -----------------------------------------------------------
    def insert(self, key: RadixKey, device_slots: torch.Tensor, priority: int = 0, chunked: bool = False) -> int:
        """Cache ``key`` whose KV sits in ``device_slots``; returns how many of them the tree now owns.

        Slots duplicating KV the tree already holds are freed; slots past the returned count (a partial
        last page, or what lies below a node whose load failed) stay the caller's. The slots covering
        the key must be allocated, whole pages, each given once; a bad call changes nothing. Hits are
        counted as HiCache counts them: not under write_back, not for a ``chunked`` insert (one chunk
        of a prefill in progress: the prompt has not been reused), and not for nodes this insert
        revived (recomputed KV for a host-only node).
        Lock contract: takes no lock; may lock nodes for a write-through.
        """
        if not isinstance(device_slots, torch.Tensor) or device_slots.dim() != 1 or device_slots.dtype != torch.int64:
            raise TypeError(f"device_slots must be a 1-D int64 tensor, got {_describe(device_slots)}")
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if not isinstance(chunked, bool):
            raise TypeError(f"chunked must be a bool, got {chunked!r}")
        num_elems = self.tree.num_elements(key)
        if len(device_slots) < num_elems:
            raise ValueError(f"device_slots of length {len(device_slots)} is shorter than the key's {num_elems} "
                             "elements")
        self.device_pool.allocator.check_allocated(device_slots[:num_elems], "device_slots")
        self._note_failed_loads()
        if self.failed_loads:
            key, device_slots = self.failed_loads.cut_key(key, device_slots)
        with plain_slot_slices():  # the nodes' slices of device_slots
            result = self.tree.insert(key, device_slots, priority)
        self._free_duplicates(device_slots, result.shared)
        owned = result.prefix_len + (len(result.new_node) if result.new_node else 0)
        if chunked:
            return owned
        revived = {id(n) for n in result.revived}
        threshold = self.config.write_threshold
        for node in result.path:
            if id(node) not in revived:
                self.priority.on_access(node)  # the policy counts uses itself (Policy.uses)
                if threshold is not None:  # the seed's hit_count counts for write-through only
                    node.hit_count += 1
        if result.new_node is not None:
            self.priority.on_insert(result.new_node)
        if self.transfer is not None and threshold is not None:
            hot = [n for n in result.path if n.host_value is None and n.hit_count >= threshold]
            if hot and self._admit(hot[-1]):
                self.write_backup(hot[-1])
        return owned

    def _free_duplicates(self, device_slots: torch.Tensor, shared: list[tuple[TreeNode, int, int]]) -> None:
        """Free the caller's slots that duplicate KV already held by ``shared`` nodes, in one batch
        (numpy: a long prompt shares dozens of nodes, and per-node torch ops dominated inserts)."""
        if not shared:
            return
        mine = device_slots.numpy()
        held = [n.device_value.numpy() for n, _, _ in shared]
        if shared[-1][2] == sum(len(h) for h in held):  # shared nodes cover [0, end): one compare
            mine, held = mine[:shared[-1][2]], np.concatenate(held)
        else:
            mine = np.concatenate([mine[start:end] for _, start, end in shared])
            held = np.concatenate(held)
        duplicate = mine[mine != held]
        if len(duplicate):
            self.device_pool.free(torch.from_numpy(duplicate))

    def write_backup(self, node: TreeNode) -> bool:
        """Back ``node`` (and any ancestor not yet in L2) up to L2 asynchronously.

        Lock contract: locks the path in L1 and protects it in L2 until the write is acknowledged.
        Returns False when L2 has no room even after evicting from it (the node stays L1-only).
        """
        path = self._unbacked_path(node)
        if not path:
            return True
        num_tokens = sum(len(n) for n in path)
        self.tree.inc_host_ref(node)  # making room in L2 must not drop the backup this path extends
        host_slots = self._alloc_host(num_tokens)
        if host_slots is None:
            self.tree.dec_host_ref(node)
            self.stats.write_skipped_tokens += num_tokens
            return False
        device_slots = torch.cat([n.device_value for n in path])
        self._assign_host_values(path, host_slots)
        self.tree.inc_lock_ref(node)
        self.transfer.write(device_slots, host_slots, PendingWrite(node, host_slots, num_tokens))
        return True

    def _unbacked_path(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and the ancestors up to its nearest one with an L2 copy, root side first (all in L1:
        every node holds one tier or both)."""
        path = []
        while node is not self.tree.root and node.host_value is None:
            path.append(node)
            node = node.parent
        return path[::-1]

    @staticmethod
    def _assign_host_values(path: list[TreeNode], host_slots: torch.Tensor) -> None:
        offset = 0
        for n in path:
            n.host_value = host_slots[offset:offset + len(n)]
            offset += len(n)

    # ---- completion of asynchronous work -------------------------------------------------------
    def local_progress(self) -> tuple[list[int], list[int]]:
        """This rank's progress: MIN counts (completed operations at the head of each ack queue, then
        storage's) and MAX flags (storage's "terminated" votes), in a fixed order."""
        if self.transfer is None:
            return [0, 0], []
        counts = [self.transfer.num_done(self.transfer.writes), self.transfer.num_done(self.transfer.loads)]
        flags: list[int] = []
        if self.storage is not None:
            storage_counts, flags = self.storage.local_progress()
            counts += storage_counts
        return counts, flags

    def apply_progress(self, min_counts: list[int], max_counts: list[int] = ()) -> None:
        """Retire the agreed number of completed operations. Lock contract: releases their locks.

        Each is retired on its own: one that raises strands no other; the first error is raised last.
        """
        if self.transfer is None:
            return
        retirements = Retirements()
        for handle, pending in self.transfer.pop_done(self.transfer.writes, min_counts[0]):
            retirements.run(self._finish_write, pending, handle)
        for handle, pending in self.transfer.pop_done(self.transfer.loads, min_counts[1]):
            retirements.run(self._finish_load, pending, handle)
        if self.storage is not None:
            retirements.run(self.storage.apply_progress, list(min_counts[2:]), list(max_counts))
        if self.failed_loads:
            retirements.run(self.failed_loads.drop_unlocked)
        retirements.raise_first()

    def step(self) -> None:
        """Once per scheduler step: agree on progress across TP ranks (one collective) and apply it."""
        self.apply_progress(*self.tp.agree(*self.local_progress()))

    def writing_check(self) -> None:
        """Retire finished writes only (a step without loads or storage). Lock contract: as apply_progress."""
        counts, flags = self.local_progress()
        self.apply_progress(*self.tp.agree([counts[0], 0] + [0] * (len(counts) - 2), [0] * len(flags)))

    def loading_check(self) -> None:
        """Retire finished loads only. Lock contract: as apply_progress."""
        counts, flags = self.local_progress()
        self.apply_progress(*self.tp.agree([0, counts[1]] + [0] * (len(counts) - 2), [0] * len(flags)))

    def _finish_write(self, pending: PendingWrite, handle: CopyHandle) -> None:
        self.tree.dec_lock_ref(pending.node)
        self.tree.dec_host_ref(pending.node)
        if handle.error is not None:
            self.stats.failed_copies += 1
            self._drop_host_slots(pending.node, pending.host_slots)
            return
        self.stats.written_tokens += pending.num_tokens
        if self.storage is not None:
            self.storage.backup(pending.node)

    def _drop_host_slots(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        """Forget host values that point into ``host_slots`` (a failed write) on ``node``'s path."""
        for n in reversed(self.tree.path_to_root(node)):
            if n.host_value is not None and torch.isin(n.host_value, host_slots).all():
                n.host_value = None
                if n.device_value is None:
                    raise AssertionError(f"node {n.id} lost both tiers after a failed write")
        self.host_pool.free(host_slots)

    def _finish_load(self, pending: PendingLoad, handle: CopyHandle) -> None:
        self.tree.dec_lock_ref(pending.node)
        self.tree.dec_host_ref(pending.node)
        if handle.error is not None:
            self.stats.failed_copies += 1
            self.failed_loads.mark(pending)
        elif self.config.tier_mode == "exclusive":  # promote: L1 has it now, so L2 need not
            freed = promote_loaded(self.tree, pending.node, len(pending.device_slots))
            if freed:
                self.host_pool.free(torch.cat(freed))

    def _admit(self, node: TreeNode) -> bool:
        return not self.config.l2_admission or self.priority.admit(node)

    def _note_failed_loads(self) -> None:
        """Mark the nodes of loads seen failed invalid at once, before their retirement."""
        if self.transfer is not None and self.transfer.loads:
            self.failed_loads.note(self.transfer.loads)

    def flush(self) -> None:
        """Wait for every copy in flight (and L3 I/O, bounded) and retire it. Lock contract: releases their locks."""
        self._finish_copies()
        if self.storage is not None:  # the writes just retired may have started backups to L3
            self.storage.flush()
            self.step()
            if self.storage.granted_in_last_step:  # that step handed prefetches their slots: wait for the reads
                self.storage.flush()
                self.step()

    def _finish_copies(self) -> None:
        """Start the deferred loads, wait for every L1<->L2 copy and retire what finished."""
        if self.transfer is not None:
            self.deferred_loads.start()
            self.transfer.synchronize()
        self.step()

    # ---- load back ---------------------------------------------------------------------------
    def init_load_back(self, last_node: TreeNode, mem_quota: int | None = None, defer: bool = False) -> LoadResult:
        """Load the host-only part of ``last_node``'s path into L1 in one batch, or none of it.

        Skipped when under ``load_back_threshold`` tokens, over ``mem_quota`` less the L1 tokens that
        locking the path makes unevictable (HiCache's delta: the quota counts them as room), or when
        L1 has no room even after eviction. Lock contract: loaded nodes stay locked until the load is
        acknowledged; the caller must :meth:`PendingLoad.wait` before reading the KV. ``defer`` queues
        the copy for :meth:`start_loading` (one layer-wise batch with the rest of the scheduler step's).
        """
        path = self.tree.path_to_root(last_node)
        if any(n.invalid for n in path):  # a failed load's nodes: not reloadable until dropped
            path = path[:next(i for i, n in enumerate(path) if n.invalid)]
            last_node = path[-1] if path else self.tree.root
        host_only = [n for n in path if n.device_value is None]
        device_part = path[: len(path) - len(host_only)]
        last_device = device_part[-1] if device_part else self.tree.root
        num_tokens = sum(len(n) for n in host_only)
        if num_tokens == 0 or self.transfer is None:
            return LoadResult(self._path_indices(device_part), last_device)
        if num_tokens < self.config.load_back_threshold:
            return LoadResult(self._path_indices(device_part), last_device)
        # Locked from here to the ack: making room in L1 must not evict the prefix we extend, and the
        # write-backs that eviction may cause must not evict from L2 the nodes we load.
        evictable_before = self.tree.evictable_size
        self.tree.inc_lock_ref(last_node)
        newly_locked = evictable_before - self.tree.evictable_size
        if mem_quota is not None and num_tokens > mem_quota - newly_locked:
            self.tree.dec_lock_ref(last_node)
            return LoadResult(self._path_indices(device_part), last_device)
        if self._loads_in_chunks(num_tokens):
            return self._load_in_chunks(host_only, last_node, device_part, last_device)
        device_slots = self._alloc_device(num_tokens)
        if device_slots is None:
            self.tree.dec_lock_ref(last_node)
            return LoadResult(self._path_indices(device_part), last_device)
        host_slots = torch.cat([n.host_value for n in host_only])
        offset = 0
        for n in host_only:
            self.tree.set_device_value(n, device_slots[offset:offset + len(n)])
            offset += len(n)
        self.tree.inc_host_ref(last_node)
        pending = PendingLoad(last_node, device_slots, handle=None)
        if defer:
            self.deferred_loads.queue(pending, host_slots)
        else:
            pending.handle = self.transfer.load(host_slots, device_slots, pending)
        self.stats.loaded_tokens += num_tokens
        return LoadResult(self._path_indices(path), last_node, pending, num_tokens)

    def _loads_in_chunks(self, num_tokens: int) -> bool:
        """Exclusive tiers load in chunks (:mod:`tierkv.chunked_load`, synchronously, one chunk or more)
        when L1's demotions for the load would not fit in L2's free room (the staging reserve apart)."""
        if self.config.tier_mode != "exclusive" or not self.config.load_chunk_tokens:
            return False
        if self.transfer.loads:
            self.loading_check()  # finished loads promoted first: their L2 slots are free room too
        return num_tokens - self.device_pool.num_free_slots > self._host_room

    @property
    def _chunk_tokens(self) -> int:
        page = self.config.page_size
        return max(page, self.config.load_chunk_tokens // page * page)

    def _load_in_chunks(self, host_only: list[TreeNode], last_node: TreeNode, device_part: list[TreeNode],
                        last_device: TreeNode) -> LoadResult:
        """Load the host-only path synchronously, chunk by chunk; what loaded is served even if a chunk
        does not load. Lock contract: releases the caller's lock on ``last_node`` (the KV is in L1)."""
        try:
            loaded = ChunkedLoad(self, host_only, self._chunk_tokens).run()
        finally:
            self.tree.dec_lock_ref(last_node)
        if not loaded:
            return LoadResult(self._path_indices(device_part), last_device)
        return LoadResult(self._path_indices(self.tree.path_to_root(loaded[-1])), loaded[-1], None,
                          sum(len(n) for n in loaded))

    def start_loading(self) -> LayerLoads:
        """Start the deferred loads as one layer-wise batch; the forward pass calls ``wait_layer(i)`` on
        the result before layer ``i`` reads KV. Lock contract: takes none (each load holds its own)."""
        if self.transfer is None:
            return LayerLoads()
        return self.deferred_loads.start()

    @staticmethod
    def _path_indices(nodes: list[TreeNode]) -> torch.Tensor:
        return torch.cat([n.device_value for n in nodes]) if nodes else _EMPTY

    def _alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.device_pool.alloc(num_tokens)
        if slots is None:
            if self.config.tier_mode == "exclusive" and self.transfer is not None and self.transfer.loads:
                self.loading_check()  # promote finished loads first: the demotions take their L2 slots
            self.evict(num_tokens - self.device_pool.num_free_slots)
            slots = self.device_pool.alloc(num_tokens)
        return slots

    @property
    def _host_room(self) -> int:
        """L2 slots free beyond the staging reserve."""
        return self.host_pool.num_free_slots - self.host_reserve_tokens

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens > self._host_room:
            self.evict_host(num_tokens - self._host_room)
            if num_tokens > self._host_room:
                return None
        return self.host_pool.alloc(num_tokens)

    def restore_host_reserve(self) -> None:
        """Staging closed: evict from L2 until the reserve is free again (what a chunk's demotions took
        beyond the L2 slots it freed). Lock contract: as :meth:`evict_host`."""
        self.host_reserve_tokens = self.config.staging_tokens
        if self._host_room < 0:
            self.evict_host(-self._host_room)

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for a request's new tokens, evicting from L1 if needed. Lock contract: takes no lock."""
        self.device_pool.allocator.check_num_tokens(num_tokens)  # before evicting anything
        return self._alloc_device(num_tokens)

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """L2 slots, evicting from L2 if needed (for the L3 tier). Lock contract: takes no lock."""
        if self.host_pool is None:
            raise ValueError("this cache has no host (L2) tier")
        self.host_pool.allocator.check_num_tokens(num_tokens)
        return self._alloc_host(num_tokens)

    # ---- maintenance -------------------------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    @property
    def protected_size(self) -> int:
        return self.tree.protected_size

    def get_height(self, node: TreeNode) -> int:
        """``node``'s depth: the nodes from the root down to it (the root is 0), as HiCache's. Lock contract: none."""
        return len(self.tree.path_to_root(node))

    def reset(self, clear_storage: bool = False) -> None:
        """Drop every cached token in L1 and L2, and in L3 only when ``clear_storage`` (L3 may be shared
        by other servers). Lock contract: no request may hold a lock."""
        self.flush()
        if self.storage is not None:  # first: L3 I/O still in flight keeps owning its host slots
            self.storage.reset(clear_storage)
        self.tree.reset()
        self.failed_loads.clear()
        self.device_pool.allocator.reset()
        if self.host_pool is not None:
            owned = self.storage.owned_host_slots() if self.storage is not None else []
            self.host_pool.allocator.reset(keep=torch.cat(owned) if owned else None)
            self.step()  # frees at once what drained but is already finished on every rank
        self.stats = CacheStats()

    def close(self) -> None:
        """Finish in-flight copies and stop background threads; L3 workers get one ``io_wait_timeout_s``
        in all (a flush first would spend a second one waiting for them)."""
        self._finish_copies()
        if self.storage is not None:
            self.storage.close()
        if self.transfer is not None:
            self.transfer.shutdown()

    def check_integrity(self, caller_device_slots: torch.Tensor | None = None,
                        caller_host_slots: torch.Tensor | None = None) -> None:
        """Check the tree and that every allocated slot has exactly one owner (tree, in-flight, caller)."""
        self.tree.check_integrity()
        self.failed_loads.check()
        device_owned = [n.device_value for n in self.tree.nodes() if n.device_value is not None]
        if caller_device_slots is not None:
            device_owned.append(caller_device_slots)
        self.device_pool.allocator.check_ownership("device", device_owned)
        if self.host_pool is not None:
            host_owned = [n.host_value for n in self.tree.nodes() if n.host_value is not None]
            if self.storage is not None:
                host_owned += self.storage.owned_host_slots()
            if caller_host_slots is not None:
                host_owned.append(caller_host_slots)
            self.host_pool.allocator.check_ownership("host", host_owned)
            if self.host_reserve_tokens != self.config.staging_tokens or self._host_room < 0:
                raise AssertionError(f"staging reserve not free at rest: {self.host_pool.num_free_slots} L2 slots "
                                     f"free, {self.host_reserve_tokens} reserved of {self.config.staging_tokens}")


def _cut(path: MatchPath, num_nodes: int) -> None:
    """Keep the first ``num_nodes`` nodes of a match path."""
    if num_nodes < len(path.nodes):
        path.nodes = path.nodes[:num_nodes]
        path.num_tokens = sum(len(n) for n in path.nodes)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__
