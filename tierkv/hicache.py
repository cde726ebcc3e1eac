"""The hierarchical cache: ties the radix tree, the L1/L2 pools and the transfer controller.

Thread contract: every public method runs on the scheduler thread. Background threads (copies, storage
I/O) never touch the tree; their results arrive through ack queues drained by :meth:`step`.

Tier invariants (checked by :meth:`check_integrity`): nodes holding device slots form a subtree at the
root, and so do nodes holding host slots; every node holds one or both. A node's slots in each tier are
owned by it alone, and every allocated slot is owned by a node, an in-flight operation or a caller.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.config import CacheConfig
from tierkv.eviction import eviction_order, get_policy
from tierkv.eviction.tiers import promote_loaded, tier_orders
from tierkv.pools.kv import DeviceKVPool, HostKVPool, host_pool_tokens
from tierkv.hashing import HashNamespace
from tierkv.radix import RadixKey, RadixTree, TreeNode
from tierkv.storage.base import PageStore
from tierkv.storage.config import StorageConfig
from tierkv.storage.controller import StorageController
from tierkv.tp import TPGroup
from tierkv.transfer import CopyHandle, TransferController, resolve_host_layout

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class MatchResult:
    """What a prefix lookup found: the L1 part (usable now) and the L2 part behind it."""

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


@dataclass
class CacheStats:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    written_tokens: int = 0
    loaded_tokens: int = 0
    write_skipped_tokens: int = 0
    failed_copies: int = 0


@dataclass
class PendingWrite:
    """An L1 -> L2 backup in flight: ``node``'s path is locked (L1) and protected (L2) until it completes."""

    node: TreeNode
    host_slots: torch.Tensor
    num_tokens: int


@dataclass
class PendingLoad:
    """An L2 -> L1 load in flight: ``node``'s path is locked and protected until it completes."""

    node: TreeNode
    device_slots: torch.Tensor
    handle: CopyHandle

    def wait(self) -> bool:
        """Block until the KV is in L1; False if the copy failed (its slots hold no valid KV)."""
        self.handle.wait()
        return self.handle.error is None


@dataclass
class _WriteBackBatch:
    """Write-backs of one eviction pass: copied in one batch, then the evicted device slots are freed."""

    device_slots: list[torch.Tensor] = field(default_factory=list)
    host_slots: list[torch.Tensor] = field(default_factory=list)
    protected: list[TreeNode] = field(default_factory=list)  # host_ref held until the copy ends
    backed_up: list[TreeNode] = field(default_factory=list)  # every node given host slots
    evicted_slots: list[torch.Tensor] = field(default_factory=list)


@dataclass
class LoadResult:
    """Outcome of :meth:`HiRadixCache.init_load_back`: the device indices of the whole usable prefix."""

    device_indices: torch.Tensor
    last_node: TreeNode
    pending: PendingLoad | None = None
    loaded_tokens: int = 0


class HiRadixCache:
    """Prefix cache over L1 (device) and L2 (host) tiers; see the module docstring for contracts."""

    def __init__(self, device_pool: DeviceKVPool, config: CacheConfig | None = None,
                 host_pool: HostKVPool | None = None, tp: TPGroup | None = None) -> None:
        self.config = config or CacheConfig()
        if device_pool.page_size != self.config.page_size:
            raise ValueError(f"device pool page_size {device_pool.page_size} != config page_size "
                             f"{self.config.page_size}")
        self.device_pool = device_pool
        self.tree = RadixTree(self.config.page_size, bigram=self.config.bigram)
        self.priority = get_policy(self.config.eviction_policy)
        self._device_order, self._host_order = tier_orders(self.priority, self.config.tier_mode)
        self.tp = tp or TPGroup.single()
        self.stats = CacheStats()
        self.host_pool = host_pool
        self.transfer: TransferController | None = None
        if self.config.enable_host:
            self.host_pool = host_pool or self._make_host_pool()
            self.transfer = TransferController(device_pool, self.host_pool, self.config.io_backend)
        self.storage: StorageController | None = None  # the L3 tier: see attach_storage

    def _make_host_pool(self) -> HostKVPool:
        cfg, spec = self.config, self.device_pool.spec
        layout = resolve_host_layout(cfg.host_layout, cfg.io_backend)
        tokens = host_pool_tokens(self.device_pool.num_slots, spec.bytes_per_token, cfg.page_size,
                                  cfg.hicache_ratio, cfg.hicache_size_gb)
        return HostKVPool(spec, tokens, cfg.page_size, layout)

    # ---- lookup ---------------------------------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached prefix of ``key`` in L1 and L2. Lock contract: takes no lock (caller locks).

        Device indices filled by another request's load still in flight are waited for (on CUDA the
        current stream waits on the load's event), so the returned KV is always ready to read.
        """
        path = self.tree.match(key)
        device_nodes = []
        for node in path.nodes:
            if node.device_value is None:
                break
            device_nodes.append(node)
        usable = self._wait_for_loads(device_nodes)
        if usable < len(device_nodes):  # a failed load: its nodes are garbage until retired
            device_nodes, path.nodes = device_nodes[:usable], path.nodes[:usable]
            path.num_tokens = sum(len(n) for n in path.nodes)
        last_device = device_nodes[-1] if device_nodes else self.tree.root
        device_hit = sum(len(n) for n in device_nodes)
        host_hit = path.num_tokens - device_hit
        self.stats.device_hit_tokens += device_hit
        self.stats.host_hit_tokens += host_hit
        return MatchResult(self._path_indices(device_nodes), last_device, path.last_node or self.tree.root,
                           host_hit)

    def _wait_for_loads(self, device_nodes: list[TreeNode]) -> int:
        """Wait for in-flight loads into these nodes; how many leading nodes hold valid KV."""
        if self.transfer is None or not self.transfer.loads or not device_nodes:
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
                    usable = min(usable, hit[0])
        return usable

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock contract: locks ``node``'s path in L1 (never evicted) until :meth:`dec_lock_ref`."""
        self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Lock contract: releases one lock taken by :meth:`inc_lock_ref` on ``node``."""
        self.tree.dec_lock_ref(node)

    # ---- insert and write policies -----------------------------------------------------------
    def insert(self, key: RadixKey, device_slots: torch.Tensor, priority: int = 0) -> int:
        """Cache ``key`` whose KV sits in ``device_slots``; returns how many of them the tree now owns.

        Slots duplicating KV the tree already holds are freed; slots past the returned count (a partial
        last page) stay the caller's. Lock contract: takes no lock; may lock nodes for a write-through.
        """
        if not isinstance(device_slots, torch.Tensor) or device_slots.dim() != 1 or device_slots.dtype != torch.int64:
            raise TypeError(f"device_slots must be a 1-D int64 tensor, got {_describe(device_slots)}")
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        result = self.tree.insert(key, device_slots, priority)
        self._free_duplicates(device_slots, result.shared)
        for node in result.path:
            self.priority.on_access(node)  # before the count: policies class a use by the uses before it
            node.hit_count += 1
        if result.new_node is not None:
            self.priority.on_insert(result.new_node)
        threshold = self.config.write_threshold
        if self.transfer is not None and threshold is not None:
            hot = [n for n in result.path if n.host_value is None and n.hit_count >= threshold]
            if hot and self._admit(hot[-1]):
                self.write_backup(hot[-1])
        return result.prefix_len + (len(result.new_node) if result.new_node else 0)

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
        """``node`` and its ancestors without an L2 copy, root side first (host nodes form a rooted subtree)."""
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
    def local_progress(self) -> list[int]:
        """Counts of completed operations at the head of each ack queue, in a fixed order."""
        if self.transfer is None:
            return [0, 0]
        counts = [self.transfer.num_done(self.transfer.writes), self.transfer.num_done(self.transfer.loads)]
        if self.storage is not None:
            counts += self.storage.local_progress()
        return counts

    def apply_progress(self, counts: list[int]) -> None:
        """Retire the agreed number of completed operations. Lock contract: releases their locks."""
        if self.transfer is None:
            return
        for handle, pending in self.transfer.pop_done(self.transfer.writes, counts[0]):
            self._finish_write(pending, handle)
        for handle, pending in self.transfer.pop_done(self.transfer.loads, counts[1]):
            self._finish_load(pending, handle)
        if self.storage is not None:
            self.storage.apply_progress(counts[2:])

    def step(self) -> None:
        """Once per scheduler step: agree on progress across TP ranks (one collective) and apply it."""
        self.apply_progress(self.tp.all_reduce_min(self.local_progress()))

    def writing_check(self) -> None:
        """Retire finished writes only (a step without loads or storage). Lock contract: as apply_progress."""
        counts = self.local_progress()
        self.apply_progress(self.tp.all_reduce_min([counts[0], 0] + [0] * (len(counts) - 2)))

    def loading_check(self) -> None:
        """Retire finished loads only. Lock contract: as apply_progress."""
        counts = self.local_progress()
        self.apply_progress(self.tp.all_reduce_min([0, counts[1]] + [0] * (len(counts) - 2)))

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
            self._drop_loaded(pending)
        elif self.config.tier_mode == "exclusive":  # promote: L1 has it now, so L2 need not
            freed = promote_loaded(self.tree, pending.node, len(pending.device_slots))
            if freed:
                self.host_pool.free(torch.cat(freed))

    def _admit(self, node: TreeNode) -> bool:
        return not self.config.l2_admission or self.priority.admit(node)

    def _drop_loaded(self, pending: PendingLoad) -> None:
        """A failed load left garbage in its device slots: evict them again (unlocked nodes only)."""
        for n in reversed(self.tree.path_to_root(pending.node)):
            if n.device_value is not None and n.lock_ref == 0 and torch.isin(n.device_value,
                                                                             pending.device_slots).all():
                self.device_pool.free(self.tree.clear_device_value(n))

    def flush(self) -> None:
        """Wait for every copy in flight (and L3 I/O, bounded) and retire it. Lock contract: releases their locks."""
        if self.transfer is not None:
            self.transfer.synchronize()
        self.step()
        if self.storage is not None:  # the writes just retired may have started backups to L3
            self.storage.flush()
            self.step()

    # ---- load back ---------------------------------------------------------------------------
    def init_load_back(self, last_node: TreeNode, mem_quota: int | None = None) -> LoadResult:
        """Load the host-only part of ``last_node``'s path into L1 in one batch, or none of it.

        Skipped when under ``load_back_threshold`` tokens, over ``mem_quota`` or when L1 has no room
        even after eviction. Lock contract: loaded nodes stay locked until the load is acknowledged;
        the caller must :meth:`PendingLoad.wait` before reading the KV.
        """
        path = self.tree.path_to_root(last_node)
        host_only = [n for n in path if n.device_value is None]
        device_part = path[: len(path) - len(host_only)]
        last_device = device_part[-1] if device_part else self.tree.root
        num_tokens = sum(len(n) for n in host_only)
        if num_tokens == 0 or self.transfer is None:
            return LoadResult(self._path_indices(device_part), last_device)
        too_small = num_tokens < self.config.load_back_threshold
        if too_small or (mem_quota is not None and num_tokens > mem_quota):
            return LoadResult(self._path_indices(device_part), last_device)
        # Locked from here to the ack: making room in L1 must not evict the prefix we extend, and the
        # write-backs that eviction may cause must not evict from L2 the nodes we load.
        self.tree.inc_lock_ref(last_node)
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
        pending = PendingLoad(last_node, device_slots, handle=None)  # type: ignore[arg-type]
        pending.handle = self.transfer.load(host_slots, device_slots, pending)
        self.stats.loaded_tokens += num_tokens
        return LoadResult(self._path_indices(path), last_node, pending, num_tokens)

    @staticmethod
    def _path_indices(nodes: list[TreeNode]) -> torch.Tensor:
        return torch.cat([n.device_value for n in nodes]) if nodes else _EMPTY

    # ---- eviction ----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if that many are evictable; returns the number freed.

        Backed-up nodes drop their device slots and stay host-only; others are deleted, or under
        write_back copied to L2 first (one batch copy, waited for). Lock contract: skips locked nodes.
        """
        freed, batch = 0, _WriteBackBatch()
        write_back = self.config.writes_on_evict and self.transfer is not None
        order = eviction_order(self.tree.device_leaves(), self._device_order, self._next_device_candidate)
        for node in order:
            if freed >= num_tokens:
                break
            if write_back and node.host_value is None and self._admit(node):
                self._reserve_write_back(node, batch)
            freed += len(node)
            # freed only after the batch copy: a write-back may still read these slots
            batch.evicted_slots.append(self.tree.clear_device_value(node))
            if node.host_value is None:
                self.tree.remove_leaf(node)
            self.priority.on_evict(node, removed=node.host_value is None)
        self._finish_write_back(batch)
        if batch.evicted_slots:
            self.device_pool.free(torch.cat(batch.evicted_slots))
        self.stats.evicted_device_tokens += freed
        return freed

    def _next_device_candidate(self, node: TreeNode) -> TreeNode | None:
        parent = node.parent
        return parent if parent is not None and self.tree.is_device_leaf(parent) else None

    def _reserve_write_back(self, node: TreeNode, batch: "_WriteBackBatch") -> None:
        """Give ``node`` and its ancestors not yet in L2 host slots, protected until the batch copy ends."""
        path = self._unbacked_path(node)
        num_tokens = sum(len(n) for n in path)
        self.tree.inc_host_ref(node)
        host_slots = self._alloc_host(num_tokens)
        if host_slots is None:
            self.tree.dec_host_ref(node)
            self.stats.write_skipped_tokens += num_tokens
            return
        batch.device_slots.append(torch.cat([n.device_value for n in path]))
        batch.host_slots.append(host_slots)
        self._assign_host_values(path, host_slots)
        batch.protected.append(node)
        batch.backed_up.extend(path)

    def _finish_write_back(self, batch: "_WriteBackBatch") -> None:
        if not batch.protected:
            return
        device_slots = torch.cat(batch.device_slots)
        error = self.transfer.write_now(device_slots, torch.cat(batch.host_slots))
        for n in batch.protected:
            self.tree.dec_host_ref(n)
        if error is not None:
            self.stats.failed_copies += 1
            self.host_pool.free(torch.cat(batch.host_slots))
            # deepest first, so a node is childless by the time it is removed
            for n in sorted(batch.backed_up, key=lambda n: -len(self.tree.path_to_root(n))):
                n.host_value = None
                if n.device_value is None:
                    self.tree.remove_leaf(n)
            return
        self.stats.written_tokens += len(device_slots)
        if self.storage is not None:
            for n in batch.protected:
                self.storage.backup(n)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L2 slots if possible; returns the number freed.

        Host-only leaves are deleted; L1-resident leaves just drop their backup. Lock contract: skips
        nodes with host_ref (in-flight writes, loads, backups) and locked host-only nodes.
        """
        freed, evicted_slots = 0, []
        order = eviction_order(self.tree.host_leaves(), self._host_order, self._next_host_candidate)
        for node in order:
            if freed >= num_tokens:
                break
            freed += len(node)
            evicted_slots.append(node.host_value)
            node.host_value = None
            if node.device_value is None:
                self.tree.remove_leaf(node)
            self.priority.on_evict(node, removed=node.device_value is None)
        if evicted_slots:  # one free: each call validates its slots, which dominates for small nodes
            self.host_pool.free(torch.cat(evicted_slots))
        self.stats.evicted_host_tokens += freed
        return freed

    def _next_host_candidate(self, node: TreeNode) -> TreeNode | None:
        parent = node.parent
        return parent if parent is not None and self.tree.is_host_leaf(parent) else None

    def _alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.device_pool.alloc(num_tokens)
        if slots is None:
            self.evict(num_tokens - self.device_pool.num_free_slots)
            slots = self.device_pool.alloc(num_tokens)
        return slots

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host_pool.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_pool.num_free_slots)
            slots = self.host_pool.alloc(num_tokens)
        return slots

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for a request's new tokens, evicting from L1 if needed. Lock contract: takes no lock."""
        return self._alloc_device(num_tokens)

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """L2 slots, evicting from L2 if needed (for the L3 tier). Lock contract: takes no lock."""
        return self._alloc_host(num_tokens)

    # ---- L3 storage (tierkv.storage.controller) --------------------------------------------------
    def attach_storage(self, store: PageStore, config: StorageConfig, namespace: HashNamespace | str) -> None:
        """Add the L3 tier: prefetch into L2 and backup from L2 against ``store``. Lock contract: none."""
        if self.storage is not None:
            raise ValueError("this cache already has a storage tier")
        if self.transfer is None:
            raise ValueError("an L3 tier needs the host (L2) tier: enable_host=True")
        self.storage = StorageController(self, store, config, namespace)

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

    # ---- maintenance -------------------------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    @property
    def protected_size(self) -> int:
        return self.tree.protected_size

    def reset(self, clear_storage: bool = False) -> None:
        """Drop every cached token in L1 and L2, and in L3 only when ``clear_storage`` (L3 may be shared
        by other servers). Lock contract: no request may hold a lock."""
        self.flush()
        self.tree.reset()
        self.device_pool.allocator.reset()
        if self.host_pool is not None:
            self.host_pool.allocator.reset()
        if self.storage is not None:
            self.storage.reset(clear_storage)
        self.stats = CacheStats()

    def close(self) -> None:
        """Finish in-flight work and stop background threads."""
        self.flush()
        if self.storage is not None:
            self.storage.close()
        if self.transfer is not None:
            self.transfer.shutdown()

    def check_integrity(self, caller_device_slots: torch.Tensor | None = None,
                        caller_host_slots: torch.Tensor | None = None) -> None:
        """Check the tree and that every allocated slot has exactly one owner (tree, in-flight, caller)."""
        self.tree.check_integrity()
        device_owned = [n.device_value for n in self.tree.nodes() if n.device_value is not None]
        if caller_device_slots is not None:
            device_owned.append(caller_device_slots)
        _check_ownership("device", self.device_pool, device_owned)
        if self.host_pool is not None:
            host_owned = [n.host_value for n in self.tree.nodes() if n.host_value is not None]
            if self.storage is not None:
                host_owned += self.storage.owned_host_slots()
            if caller_host_slots is not None:
                host_owned.append(caller_host_slots)
            _check_ownership("host", self.host_pool, host_owned)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__


def _check_ownership(tier: str, pool: DeviceKVPool | HostKVPool, owned: list[torch.Tensor]) -> None:
    slots = torch.cat(owned) if owned else _EMPTY
    if slots.dtype != torch.int64:
        raise AssertionError(f"{tier} slots of dtype {slots.dtype}, expected int64")
    if len(slots) and (slots.min() < 0 or slots.max() >= pool.num_slots):
        raise AssertionError(f"{tier} slots outside [0, {pool.num_slots})")
    if pool.page_size > 1:  # every owner holds whole aligned pages, so pages are freed whole
        if any(len(v) % pool.page_size for v in owned):
            raise AssertionError(f"{tier} slots owned in partial pages")
        rows = slots.view(-1, pool.page_size)
        aligned = rows[:, :1] - rows[:, :1] % pool.page_size + torch.arange(pool.page_size)
        if not torch.equal(rows, aligned):
            raise AssertionError(f"{tier} slots not in whole aligned pages")
    counts = torch.bincount(slots, minlength=pool.num_slots) if len(slots) else torch.zeros(
        pool.num_slots, dtype=torch.int64)
    if (counts > 1).any():
        raise AssertionError(f"{tier} slots owned twice: {torch.nonzero(counts > 1).flatten()[:8].tolist()}")
    allocated = pool.allocator.owned_mask().repeat_interleave(pool.page_size)
    owned_mask = counts > 0
    if not torch.equal(allocated, owned_mask):
        leaked = torch.nonzero(allocated & ~owned_mask).flatten()[:8].tolist()
        stray = torch.nonzero(owned_mask & ~allocated).flatten()[:8].tolist()
        raise AssertionError(f"{tier} pool: leaked slots {leaked}, owned but free {stray}")
