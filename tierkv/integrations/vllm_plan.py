"""The scheduler half of the vLLM connector, free of vLLM imports: tierkv's tree over L2 plus L3 lookups.

vLLM runs its scheduler and its workers in different processes (EngineCore and Worker), so the two
halves share no memory. The scheduler half owns the truth about L2: a :class:`tierkv.radix.RadixTree`
whose nodes hold L2 page slots (a :class:`tierkv.pools.allocator.SlotAllocator` hands them out) and
chained page hashes. It plans every copy and sends the plan to the worker in the step's metadata; the
worker half (:mod:`tierkv.integrations.vllm_io`) owns the L2 bytes and the L3 I/O and reports back
through the worker metadata. What the scheduler knows about L3 it learns from ``batch_exists`` on its
own client of the same store: L3 is the truth shared by every process.

Protection: a request holds one host_ref on the deepest L2 node of its prefix (its hit, then every
block it saved) until it finishes and its async load, if any, is reported done; an L3 backup holds one
host_ref on its node until the worker reports it written. Protected pages are never evicted, so a
page the worker reads is never re-planned as a write target meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from tierkv.eviction import get_policy
from tierkv.eviction.heap import EvictionHeap
from tierkv.hashing import page_hashes
from tierkv.integrations.vllm_config import ConnectorConfig, KVGeometry
from tierkv.pools.allocator import SlotAllocator
from tierkv.radix import RadixKey, RadixTree, TreeNode
from tierkv.storage.base import PageStore
from tierkv.storage.worker import IOWorker

log = logging.getLogger(__name__)


@dataclass
class LoadOp:
    """Copy pages into a request's vLLM blocks: ``host_pages`` (L2) first, then ``l3_keys`` (L3)."""

    req_id: str
    block_ids: list[int]
    host_pages: list[int]
    l3_keys: list[str]
    is_async: bool


@dataclass
class SaveOp:
    """Copy full vLLM blocks into L2 pages; ``backup_id`` >= 0 asks the worker to write them to L3 too."""

    block_ids: list[int]
    host_pages: list[int]
    keys: list[str]
    backup_id: int = -1


@dataclass
class StepPlan:
    """What the worker does this step (sent to it as the connector metadata)."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters of the scheduler half (tokens unless named otherwise)."""

    lookups: int = 0
    l2_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    l3_lookup_timeouts: int = 0
    saved_tokens: int = 0
    save_skipped_tokens: int = 0
    backups_started: int = 0
    backups_done: int = 0
    backup_dropped_tokens: int = 0
    evicted_tokens: int = 0
    # reported by the worker
    loaded_l2_tokens: int = 0
    loaded_l3_tokens: int = 0
    failed_load_tokens: int = 0
    backed_up_tokens: int = 0
    # tierkv's own cost in vLLM's step: engine steps planned, and wall time inside the connector's methods
    steps: int = 0
    scheduler_busy_us: int = 0
    worker_busy_us: int = 0  # summed over ranks


@dataclass(eq=False)
class _Lookup:
    """A background ``batch_exists`` over the pages beyond the L2 hit."""

    keys: list[str]
    deadline_s: float
    found_pages: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, store: PageStore) -> None:
        try:
            self.found_pages = store.batch_exists(self.keys)
        finally:
            self.done.set()


@dataclass(eq=False)
class _Request:
    """The scheduler half's view of one request."""

    req_id: str
    extra_key: str | None = None  # the request's namespace (cache salt, LoRA adapter): its own pages and keys
    hashes: list[str] = field(default_factory=list)
    protected: TreeNode | None = None  # holds one host_ref
    saved_tokens: int = 0
    save_stopped: bool = False
    lookup: _Lookup | None = None
    planned: tuple[int, int, int] | None = None  # (vLLM's hit, L2 end, L3 end) in tokens
    load_pending: bool = False
    l3_used: bool = False  # one async load per request: a failed one must not be planned again
    finished: bool = False


class SchedulerTiers:
    """tierkv's tree over L2 and the L3 lookups, driven by the vLLM connector's scheduler hooks.

    Thread contract: every method runs on vLLM's scheduler thread; only :class:`_Lookup` jobs run on
    the lookup thread and they touch nothing but their own fields.
    """

    def __init__(self, config: ConnectorConfig, geometry: KVGeometry, store: PageStore | None) -> None:
        self.config, self.geometry = config, geometry
        self.page_size = geometry.block_size
        self.tree = RadixTree(self.page_size)
        self.allocator = SlotAllocator(geometry.host_pages * self.page_size, self.page_size)
        self.priority = get_policy(config.eviction_policy)
        self.tree.split_hook = self.priority.on_split
        self._host_heap = EvictionHeap(self.tree, "host", self.priority)
        self.namespace = geometry.hash_namespace()
        self.store = store
        self.stats = ConnectorStats()
        self.requests: dict[str, _Request] = {}
        self.plan = StepPlan()
        self.backups: dict[int, tuple[TreeNode, int]] = {}
        self._backup_ids = itertools.count()
        self._lookup_worker = IOWorker("tierkv-vllm-lookup") if store is not None else None

    # ---- hits ------------------------------------------------------------------------------------
    def _hashes(self, req: _Request, tokens: list[int]) -> list[str]:
        """Chained hashes of every full page of ``tokens``, extended incrementally."""
        num_pages = len(tokens) // self.page_size
        if len(req.hashes) < num_pages:
            start = len(req.hashes) * self.page_size
            if req.hashes:
                prior = req.hashes[-1]
            else:  # the namespace's seed for the request's own extra key keeps salted chains apart
                prior = None if req.extra_key is None else self.namespace.seed(req.extra_key)
            req.hashes += page_hashes(tokens[start:num_pages * self.page_size], self.page_size, prior,
                                      self.namespace)
        return req.hashes[:num_pages]

    def num_new_matched_tokens(self, req_id: str, prompt: list[int], local_hit: int,
                               extra_key: str | None = None) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own ``local_hit`` that L2/L3 can supply; None while L3 is still asked.

        The last prompt token is never a hit (vLLM must compute one token). ``extra_key`` names the
        request's namespace (see :class:`tierkv.radix_key.RadixKey`). Lock contract: takes no lock; the
        lookup it may start owns only its own fields.
        """
        req = self._request(req_id, extra_key)
        limit = (len(prompt) - 1) // self.page_size * self.page_size
        path = self.tree.match(RadixKey(prompt[:limit], req.extra_key), touch=False)
        l2_end = path.num_tokens if path.num_tokens - local_hit >= self.config.load_back_threshold else 0
        base = max(l2_end, local_hit)  # L2 supplies [local_hit, base) when it reaches past vLLM's hit
        l3_end = base
        if (self.store is not None and not req.l3_used and limit - base > 0
                and limit - base >= self.config.storage.prefetch_threshold):
            keys = self._hashes(req, prompt[:limit])[base // self.page_size:]
            if req.lookup is None or req.lookup.keys != keys:
                timeout_s = self.config.storage.prefetch_timeout_s(len(keys) * self.page_size)
                req.lookup = _Lookup(keys, time.monotonic() + timeout_s)
                self.stats.lookups += 1
                self._lookup_worker.submit(lambda lookup=req.lookup: lookup.run(self.store))
            if not req.lookup.done.is_set():
                if time.monotonic() < req.lookup.deadline_s:
                    return None, False
                self.stats.l3_lookup_timeouts += 1  # a hung store costs the hit, never the request
            else:
                l3_end = base + req.lookup.found_pages * self.page_size
        if l3_end <= local_hit:
            req.planned = None
            return 0, False
        req.planned = (local_hit, base, l3_end)
        return l3_end - local_hit, l3_end > base

    def _request(self, req_id: str, extra_key: str | None) -> _Request:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = _Request(req_id, extra_key)
        elif req.extra_key != extra_key:
            raise ValueError(f"request {req_id}: extra key changed from {req.extra_key!r} to {extra_key!r}")
        return req

    def after_alloc(self, req_id: str, prompt: list[int], block_ids: list[int], num_external: int,
                    extra_key: str | None = None) -> None:
        """Protect the request's L2 prefix and plan its load. Lock contract: one host_ref per request."""
        req = self._request(req_id, extra_key)
        if req.protected is None and req.saved_tokens == 0:
            path = self.tree.match(RadixKey(prompt[: len(prompt) // self.page_size * self.page_size], req.extra_key))
            for node in path.nodes:  # the request uses its L2 prefix once: policies count uses themselves
                self.priority.on_access(node)
            if path.nodes:
                self._protect(req, path.nodes[-1])
            req.saved_tokens = path.num_tokens
        if num_external <= 0 or req.planned is None:
            return
        local_hit, base, l3_end = req.planned
        req.planned = None
        end = local_hit + num_external
        if end > l3_end or end % self.page_size:
            raise RuntimeError(f"request {req_id}: vLLM allocated {num_external} external tokens after "
                               f"{local_hit}, the plan was up to {l3_end}")
        base, l3_end = min(base, end), end  # vLLM may take less than offered, never more
        host_pages = self._host_pages(prompt, local_hit, base, req.extra_key)
        # page hashes name L3 pages only: an L2-only plan does not pay for hashing the prompt
        keys = self._hashes(req, prompt[:l3_end])[base // self.page_size:] if l3_end > base else []
        first, last = local_hit // self.page_size, l3_end // self.page_size
        is_async = bool(keys)
        self.plan.loads.append(LoadOp(req_id, list(block_ids[first:last]), host_pages, keys, is_async))
        req.load_pending = is_async
        req.l3_used = req.l3_used or is_async
        req.lookup = None
        self.stats.l2_hit_tokens += base - local_hit
        self.stats.l3_hit_tokens += l3_end - base

    def _host_pages(self, prompt: list[int], start: int, end: int, extra_key: str | None) -> list[int]:
        """L2 pages holding tokens [start, end) of ``prompt`` (protected by the request's host_ref)."""
        if end <= start:
            return []
        path = self.tree.match(RadixKey(prompt[:end], extra_key))
        slots = torch.cat([n.host_value for n in path.nodes])[start:end]
        return self.allocator.slots_to_pages(slots).tolist()

    def _protect(self, req: _Request, node: TreeNode) -> None:
        self.tree.inc_host_ref(node)
        if req.protected is not None:
            self.tree.dec_host_ref(req.protected)
        req.protected = node

    # ---- saves -----------------------------------------------------------------------------------
    def wants_save(self, req_id: str, computed_tokens: int) -> bool:
        """Whether :meth:`plan_save` would do anything with ``computed_tokens`` (at most the request's length)."""
        req = self.requests.get(req_id)
        return (req is not None and not req.save_stopped and not req.load_pending
                and computed_tokens // self.page_size * self.page_size > req.saved_tokens)

    def plan_save(self, req_id: str, tokens: list[int], block_ids: list[int], computed_tokens: int) -> None:
        """Back up to L2 (and L3) every full block computed by the end of this step and not yet saved.

        Lock contract: moves the request's host_ref to its new deepest node; a backup adds one host_ref.
        """
        req = self.requests.get(req_id)
        if req is None or req.save_stopped or req.load_pending:
            return
        end = min(computed_tokens, len(tokens)) // self.page_size * self.page_size
        if end <= req.saved_tokens:
            return
        key = RadixKey(tokens[:end], req.extra_key)
        path = self.tree.match(key)
        start = path.num_tokens
        if start < req.saved_tokens:  # the request's host_ref protects its prefix: this is a bug, cost hits only
            log.warning("tierkv: request %s lost its saved prefix (%d of %d tokens); not saving it further",
                        req_id, start, req.saved_tokens)
            req.save_stopped = True
            return
        parent = path.nodes[-1] if path.nodes else self.tree.root
        if start < end:
            slots = self._alloc_host(end - start, parent)
            if slots is None:
                req.save_stopped = True
                self.stats.save_skipped_tokens += end - start
                return
            leaf = self.tree.add_leaf(parent, self.tree.elements(key)[start:], req.extra_key)
            leaf.host_value = slots
            if self.store is not None:  # the keys of the pages' L3 backup
                leaf.hash_values = self._hashes(req, tokens[:end])[start // self.page_size:]
            self.priority.on_access(leaf)  # as HiRadixCache.insert: a new leaf is used, then inserted
            self.priority.on_insert(leaf)
            op = SaveOp(list(block_ids[start // self.page_size: end // self.page_size]),
                        self.allocator.slots_to_pages(slots).tolist(), list(leaf.hash_values or ()))
            self._maybe_backup(op, leaf)
            self.plan.saves.append(op)
            self.stats.saved_tokens += end - start
            parent = leaf
        self._protect(req, parent)
        req.saved_tokens = end

    def _maybe_backup(self, op: SaveOp, node: TreeNode) -> None:
        if self.store is None:
            return
        pending = sum(len(n) for n, _ in self.backups.values())
        if pending + len(node) > self.config.storage.backup_max_pending_tokens:
            self.stats.backup_dropped_tokens += len(node)
            return
        op.backup_id = next(self._backup_ids)
        self.tree.inc_host_ref(node)
        self.backups[op.backup_id] = (node, len(node))
        self.stats.backups_started += 1

    def _alloc_host(self, num_tokens: int, keep: TreeNode) -> torch.Tensor | None:
        """L2 slots, evicting unprotected L2 leaves if needed (never ``keep``'s path)."""
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            self.tree.inc_host_ref(keep)
            try:
                self._evict(num_tokens - self.allocator.num_free_slots)
            finally:
                self.tree.dec_host_ref(keep)
            slots = self.allocator.alloc(num_tokens)
        return slots

    def _evict(self, num_tokens: int) -> None:
        freed, slots = 0, []
        for node in self._host_heap.victims() if num_tokens > 0 else ():
            freed += len(node)
            slots.append(node.host_value)
            node.host_value = None
            self.tree.remove_leaf(node)
            self.priority.on_evict(node, removed=True)  # L2 is this tree's only tier
            if freed >= num_tokens:
                break
        if slots:
            self.allocator.free(torch.cat(slots))
        self.stats.evicted_tokens += freed

    # ---- completion --------------------------------------------------------------------------------
    def take_plan(self) -> StepPlan:
        plan, self.plan = self.plan, StepPlan()
        return plan

    def on_worker_report(self, finished_loads: set[str], backups_done: list[int], counters: dict) -> None:
        """Apply what the worker reported. Lock contract: releases host_refs of finished loads and backups."""
        for backup_id in backups_done:
            node, _ = self.backups.pop(backup_id)
            self.tree.dec_host_ref(node)
            self.stats.backups_done += 1
        for name, delta in counters.items():
            setattr(self.stats, name, getattr(self.stats, name) + delta)
        for req_id in finished_loads:
            req = self.requests.get(req_id)
            if req is not None:
                req.load_pending = False
                if req.finished:
                    self._forget(req)

    def request_finished(self, req_id: str) -> None:
        """Lock contract: releases the request's host_ref (after its async load, if one is running)."""
        req = self.requests.get(req_id)
        if req is None:
            return
        req.finished = True
        if not req.load_pending:
            self._forget(req)

    def _forget(self, req: _Request) -> None:
        if req.protected is not None:
            self.tree.dec_host_ref(req.protected)
        self.requests.pop(req.req_id, None)

    def close(self) -> None:
        if self._lookup_worker is not None:
            self._lookup_worker.stop(self.config.storage.io_wait_timeout_s)
        if self.store is not None:
            self.store.close()

    def state_summary(self) -> dict:
        """In-flight state and an integrity verdict, for leak checks (tests, debugging)."""
        try:
            self.check_integrity()
            verdict = "ok"
        except AssertionError as err:
            verdict = str(err)
        return {"tracked_requests": len(self.requests), "pending_backups": len(self.backups),
                "pending_loads": sum(r.load_pending for r in self.requests.values()),
                "l2_used_pages": self.allocator.num_used_slots // self.page_size,
                "host_refs": sum(n.host_ref for n in self.tree.nodes()), "integrity": verdict}

    def check_integrity(self) -> None:
        """Tree invariants, and every allocated L2 page is owned by exactly one node."""
        self.tree.check_integrity()
        owned = [n.host_value for n in self.tree.nodes() if n.host_value is not None]
        pages = self.allocator.slots_to_pages(torch.cat(owned)) if owned else torch.empty(0, dtype=torch.int64)
        counts = torch.bincount(pages, minlength=self.allocator.num_pages)
        if (counts > 1).any() or not torch.equal(counts > 0, self.allocator.owned_mask()):
            raise AssertionError("L2 pages leaked or owned twice")
