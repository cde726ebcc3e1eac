"""The hierarchical cache's facade: ties the radix tree, the pools, the transfer controller and the parts
beside it in :mod:`tierkv.cache` (eviction, loads, failed loads, the L3 controller).

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

import torch

from tierkv.cache.config import WRITE_POLICIES, CacheConfig
from tierkv.cache.eviction import Eviction
from tierkv.cache.failed_loads import FailedLoads
from tierkv.cache.l3.controller import CacheParts, StorageController
from tierkv.cache.l3.cost_model import CostModel
from tierkv.cache.layer_load import LayerLoads
from tierkv.cache.loads import LoadBack
from tierkv.cache.node_slots import device_prefix, leaf_view, plan_slots, slot_array, unpinned
from tierkv.cache.records import CacheStats, LoadResult, MatchResult, PendingLoad, PendingWrite  # noqa: F401
from tierkv.cache.retire import Retirements
from tierkv.copy.transfer import CopyHandle, TransferController, resolve_host_layout
from tierkv.eviction import get_policy
from tierkv.hashing import HashNamespace
from tierkv.pools.allocator import owned_slot_slice, plain_slot_slices
from tierkv.pools.kv import DeviceKVPool, HostKVPool, host_pool_tokens
from tierkv.radix import InsertResult, MatchPath, RadixKey, RadixTree, TreeNode
from tierkv.storage.base import PageStore
from tierkv.storage.config import StorageConfig
from tierkv.tp import TPGroup

log = logging.getLogger(__name__)


class HiRadixCache:
    """Prefix cache over L1 (device), L2 (host) and optionally L3 (storage) tiers; see the module docstring
    for contracts.

    A facade over its parts, each handed what it needs and none aware of the cache: the tree, the pools,
    the transfer controller (:mod:`tierkv.copy.transfer`), eviction and room-making (:attr:`eviction`,
    :mod:`tierkv.cache.eviction`), L2 -> L1 loads (:attr:`loads`, :mod:`tierkv.cache.loads`), failed loads
    (:mod:`tierkv.cache.failed_loads`) and the L3 controller (:attr:`storage`, :mod:`tierkv.cache.l3.controller`).
    """

    def __init__(self, device_pool: DeviceKVPool, config: CacheConfig | None = None,
                 host_pool: HostKVPool | None = None, tp: TPGroup | None = None) -> None:
        self.config = config or CacheConfig()
        if device_pool.page_size != self.config.page_size:
            raise ValueError(f"device pool page_size {device_pool.page_size} != config page_size "
                             f"{self.config.page_size}")
        self.device_pool = device_pool
        self.tree = RadixTree(self.config.page_size, bigram=self.config.bigram, slice_value=owned_slot_slice)
        self.priority = get_policy(self.config.eviction_policy)
        self.tree.split_hook = self.priority.on_split  # a split node's halves keep its rank
        self._write_threshold = self.config.write_threshold  # the config is frozen; read once per insert
        self._l3_threshold: int | None = None  # exclusive tiers with an L3: see attach_storage
        self.tp = tp or TPGroup.single()
        self.stats = CacheStats()
        self.host_pool = host_pool
        self.transfer: TransferController | None = None
        if self.config.enable_host:
            self.host_pool = host_pool or self._make_host_pool()
            self.transfer = TransferController(device_pool, self.host_pool, self.config.io_backend,
                                               self.config.overlap_cpu_writes)
        self.storage: StorageController | None = None  # the L3 tier: see attach_storage
        self.eviction = Eviction(self.tree, self.config, self.priority, device_pool, self.host_pool, self.transfer,
                                 self.stats, retire_loads=self.loading_check, backed_up=self._back_up_to_storage)
        self.failed_loads = FailedLoads(self.tree, device_pool)
        self.loads = LoadBack(self.tree, self.config, self.eviction, self.transfer, self.failed_loads, self.stats,
                              retire_loads=self.loading_check)
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
        num_device, indices, device_hit = device_prefix(path.nodes)
        if self.transfer is not None and num_device:
            usable = self.loads.wait_for(path.nodes[:num_device])
            if usable < num_device:  # a failed load: its nodes are garbage until dropped
                _cut(path, usable)
                num_device, indices, device_hit = device_prefix(path.nodes)
        last_device = path.nodes[num_device - 1] if num_device else self.tree.root
        host_hit = path.num_tokens - device_hit
        self.stats.device_hit_tokens += device_hit
        # Tokens a prefetch just brought into L2 were counted as L3 hits when it ended: not again as L2 hits.
        fetched = self.storage.claim_fetched(path.nodes[num_device:]) if self.storage is not None else 0
        self.stats.host_hit_tokens += host_hit - fetched
        return MatchResult(indices, last_device, path.last_node or self.tree.root, host_hit)

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
        last page, or what lies below a node whose load failed) stay the caller's. The slots the tree takes
        (those of nodes it creates or revives) and those it frees must be allocated, whole pages, each given
        once, none of them one the path's nodes keep; a bad call changes nothing. Slots equal to the tree's
        own are not checked again. Hits are counted as HiCache counts them: not under write_back, not for a
        ``chunked`` insert (one chunk of a prefill in progress: the prompt has not been reused), and not for
        nodes this insert revived (recomputed KV for a host-only node).
        Lock contract: takes no lock; may lock nodes for a write-through.
        """
        if not isinstance(device_slots, torch.Tensor) or device_slots.dim() != 1 or device_slots.dtype != torch.int64:
            raise TypeError(f"device_slots must be a 1-D int64 tensor, got {_describe(device_slots)}")
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if not isinstance(chunked, bool):
            raise TypeError(f"chunked must be a bool, got {chunked!r}")
        if self.transfer is not None and self.transfer.loads:  # _note_failed_loads, inline: once per insert
            self.failed_loads.note(self.transfer.loads)
        if self.failed_loads:
            key, device_slots = self.failed_loads.cut_key(key, device_slots)
        plan = self.tree.plan_insert(key, device_slots.shape[0])  # raises on too few slots, changing nothing
        # raises on a bad call, changing nothing
        freed, revived, leaf_value = plan_slots(plan, device_slots, self.device_pool.allocator)
        if leaf_value is None and not revived and plan.walk.partial is None:
            leaf_value = leaf_view(device_slots, plan)
        if leaf_value is None or revived:  # the tree slices the parts it takes from the caller's slots
            slots = unpinned(device_slots, slot_array(device_slots), plan, revived)
        else:  # only the new leaf takes slots, and they are a copy already
            slots = device_slots
        if plan.walk.partial is None:  # new values are tensors over numpy arrays: plain already
            result = self.tree.apply_insert(plan, slots, priority, leaf_value)
        else:
            with plain_slot_slices():  # the split node's halves: slices of its tensor
                result = self.tree.apply_insert(plan, slots, priority, leaf_value)
        if freed is not None:
            self.device_pool.free(torch.from_numpy(freed))
        owned = result.prefix_len + (len(result.new_node.key) if result.new_node else 0)
        if chunked:
            return owned
        used = result.path  # revived nodes hold recomputed KV: not a use
        if result.revived:
            used = [n for n in used if all(n is not r for r in result.revived)]
        threshold = self._write_threshold
        if threshold is not None or self.priority.counts_uses_under_write_back:  # LFU's not under write_back
            # the policy counts uses itself (Policy.uses); the seed's hit_count counts for write-through only
            self.priority.on_access_all(used, count_hits=threshold is not None)
        if result.new_node is not None:
            self.priority.on_insert(result.new_node)
        if self.transfer is not None and threshold is not None:
            hot = [n for n in result.path if n.host_value is None and n.hit_count >= threshold]
            if hot and self.eviction.admit(hot[-1]):
                self.write_backup(hot[-1])
        elif self._l3_threshold is not None and self.storage is not None:
            self._back_up_inserted(result)
        return owned

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
        host_slots = self.eviction.alloc_host(num_tokens)
        if host_slots is None:
            self.tree.dec_host_ref(node)
            self.stats.write_skipped_tokens += num_tokens
            return False
        device_slots = torch.cat([n.device_value for n in path])
        self._assign_host_values(path, host_slots)
        self.tree.inc_lock_ref(node)
        self.transfer.write(device_slots, host_slots, PendingWrite(node, host_slots, num_tokens))
        return True

    def _back_up_inserted(self, result: InsertResult) -> None:
        """Exclusive tiers with an L3: back the inserted path up to L3 as write-through does in inclusive
        tiers (``write_through_selective``: only the part used before), so that other servers sharing the
        L3 hit it now, not once this one evicts it. L2 keeps no copy of what L1 holds: the pages are copied
        into host slots the backup owns until written. Lock contract: locks the path in L1 until copied."""
        path = result.path
        if self._l3_threshold > 1 and path and path[-1] is result.new_node:
            path = path[:-1]
        if not path or path[-1].in_storage:
            return
        backup = self.storage.plan_copied_backup(path[-1])
        if backup is None:
            return
        num_tokens = backup.num_tokens
        device_slots = torch.cat([n.device_value for n in backup.copied_nodes])[:num_tokens]
        self.tree.inc_lock_ref(path[-1])  # before making L2 room: nothing on the path may move
        host_slots = self.eviction.alloc_host(num_tokens)
        if host_slots is None:
            self.tree.dec_lock_ref(path[-1])
            self.stats.write_skipped_tokens += num_tokens
            _not_in_storage(backup.copied_nodes)  # a later insert or the eviction tries again
            return
        self.transfer.write(device_slots, host_slots, PendingWrite(path[-1], host_slots, num_tokens, backup))

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
            retirements.run(self.loads.finish, pending, handle)
        if self.storage is not None:
            retirements.run(self.storage.apply_progress, list(min_counts[2:]), list(max_counts))
        if self.failed_loads:
            retirements.run(self.failed_loads.drop_unlocked)
        eviction = self.eviction  # staging closed but the reserve short: a restore that L3 I/O had blocked
        if eviction.host_room < 0 and eviction.host_reserve_tokens == self.config.staging_tokens:
            retirements.run(eviction.evict_host, -eviction.host_room)
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
        if pending.backup is not None:  # a copy for L3 alone (_back_up_inserted): the backup takes its slots
            if handle.error is not None:
                self.stats.failed_copies += 1
                self.host_pool.free(pending.host_slots)
                _not_in_storage(pending.backup.copied_nodes)
                return
            self.stats.written_tokens += pending.num_tokens
            self.storage.backup_copied(pending.backup, pending.host_slots)
            return
        self.tree.dec_host_ref(pending.node)
        if handle.error is not None:
            self.stats.failed_copies += 1
            self._drop_host_slots(pending.node, pending.host_slots)
            return
        self.stats.written_tokens += pending.num_tokens
        self._back_up_to_storage(pending.node)

    def _back_up_to_storage(self, node: TreeNode) -> None:
        """``node``'s path was just written to L2: back it up to L3, if attached (see StorageController.backup),
        unless exclusive tiers backed it up at its insert."""
        if self.storage is not None and not (self._l3_threshold is not None and node.in_storage):
            self.storage.backup(node)

    def _drop_host_slots(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        """Forget host values that point into ``host_slots`` (a failed write) on ``node``'s path."""
        for n in reversed(self.tree.path_to_root(node)):
            if n.host_value is not None and torch.isin(n.host_value, host_slots).all():
                n.host_value = None
                if n.device_value is None:
                    raise AssertionError(f"node {n.id} lost both tiers after a failed write")
        self.host_pool.free(host_slots)

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
            self.loads.start()
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
        return self.loads.load(last_node, mem_quota, defer)

    def start_loading(self) -> LayerLoads:
        """Start the deferred loads as one layer-wise batch; the forward pass calls ``wait_layer(i)`` on
        the result before layer ``i`` reads KV. Lock contract: takes none (each load holds its own)."""
        return self.loads.start()

    def restore_host_reserve(self) -> None:
        """Staging closed: evict from L2 until the reserve is free again (what a chunk's demotions took
        beyond the L2 slots it freed). Lock contract: as :meth:`evict_host`."""
        self.eviction.restore_host_reserve()

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for a request's new tokens, evicting from L1 if needed. Lock contract: takes no lock."""
        self.device_pool.allocator.check_num_tokens(num_tokens)  # before evicting anything
        return self.eviction.alloc_device(num_tokens)

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """L2 slots, evicting from L2 if needed (for the L3 tier). Lock contract: takes no lock."""
        if self.host_pool is None:
            raise ValueError("this cache has no host (L2) tier")
        self.host_pool.allocator.check_num_tokens(num_tokens)
        return self.eviction.alloc_host(num_tokens)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if that many are evictable; returns the number freed (see
        :meth:`Eviction.evict`). Lock contract: skips locked nodes and nodes whose L2-only descendants
        are protected (host_ref)."""
        return self.eviction.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L2 slots if possible; returns the number freed (see
        :meth:`Eviction.evict_host`). Lock contract: skips nodes with host_ref and locked host-only nodes."""
        return self.eviction.evict_host(num_tokens)

    @property
    def host_reserve_tokens(self) -> int:
        """L2 slots kept free at rest for an exclusive chunked load's staging (CacheConfig.staging_tokens)."""
        return self.eviction.host_reserve_tokens

    # ---- the L3 tier -------------------------------------------------------------------------
    def attach_storage(self, store: PageStore, config: StorageConfig, namespace: HashNamespace | str) -> None:
        """Add the L3 tier: prefetch into L2 and backup from L2 against ``store``. Lock contract: none."""
        if self.storage is not None:
            raise ValueError("this cache already has a storage tier")
        if self.transfer is None:
            raise ValueError("an L3 tier needs the host (L2) tier: enable_host=True")
        parts = CacheParts(self.tree, self.config, self.device_pool, self.host_pool, self.tp, self.cost_model,
                           self.stats, self.alloc_host)
        self.storage = StorageController(parts, store, config, namespace)
        if self.config.tier_mode == "exclusive":  # inserts back up to L3 per write_policy (_back_up_inserted)
            self._l3_threshold = WRITE_POLICIES[self.config.write_policy]
        self.cost_model.read_back_lag_pages = self._faster_tiers_pages()

    def _faster_tiers_pages(self) -> int:
        """Pages L1 and L2 hold before a page written to L3 can be needed from it: both under exclusive
        tiers, L2 alone (which also holds what L1 does) under inclusive ones."""
        host_pages = self.host_pool.num_slots // self.config.page_size if self.host_pool is not None else 0
        if self.config.tier_mode == "exclusive":
            return host_pages + self.device_pool.num_slots // self.config.page_size
        return host_pages

    def prefetch_from_storage(self, request_id: str, last_host_node: TreeNode, key: RadixKey) -> bool:
        """Start fetching the part of ``key`` beyond ``last_host_node`` from L3 into L2; True if started.

        Lock contract: protects the L2 path it extends (host_ref) until the prefetch ends or is revoked.
        """
        return self.storage is not None and self.storage.prefetch(request_id, last_host_node, key)

    def check_prefetch_progress(self, request_id: str) -> bool:
        """True when the request may be scheduled; then its prefetch has ended and its pages are in the tree.

        Lock contract: on ending, releases the prefetch's host_ref; new nodes are host-only and unlocked.
        """
        return self.storage is None or self.storage.check_prefetch(request_id)

    def release_prefetch(self, request_id: str) -> None:
        """Abort the request's prefetch, inserting nothing. Lock contract: releases its host_ref."""
        if self.storage is not None:
            self.storage.release(request_id)

    def clear_storage_backend(self) -> bool:
        """Empty L3 (this namespace's pages), keeping L1 and L2; False when no L3 is attached or its
        backend cannot clear. Lock contract: takes no lock."""
        return self.storage is not None and self.storage.clear_store()

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
        self.stats.clear()  # in place: the parts count into it

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
            if self.transfer is not None:  # copies for L3 alone own their slots (_back_up_inserted)
                host_owned += [pending.host_slots for _, pending in self.transfer.writes
                               if isinstance(pending, PendingWrite) and pending.backup is not None]
            if caller_host_slots is not None:
                host_owned.append(caller_host_slots)
            self.host_pool.allocator.check_ownership("host", host_owned)
            # L3 I/O in flight may pin the L2 pages that would restore the reserve (a stuck store): it is
            # restored by the step that retires that I/O (apply_progress)
            short = self.eviction.host_room < 0 and not (self.storage is not None and self.storage.pins_host_pages)
            if self.host_reserve_tokens != self.config.staging_tokens or short:
                raise AssertionError(f"staging reserve not free at rest: {self.host_pool.num_free_slots} L2 slots "
                                     f"free, {self.host_reserve_tokens} reserved of {self.config.staging_tokens}")


def _cut(path: MatchPath, num_nodes: int) -> None:
    """Keep the first ``num_nodes`` nodes of a match path."""
    if num_nodes < len(path.nodes):
        path.nodes = path.nodes[:num_nodes]
        path.num_tokens = sum(len(n) for n in path.nodes)


def _not_in_storage(nodes: list[TreeNode]) -> None:
    for n in nodes:
        n.in_storage = False


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__
