"""The L3 tier of a :class:`tierkv.cache.hicache.HiRadixCache`: prefetch into L2 and backup from L2.

Thread contract: every method runs on the scheduler thread and is the only code touching the tree;
the two worker threads (prefetch, backup) only read/write host pages the in-flight object owns or
protects, and report through its counters and events.

Ownership contract: a host slot handed to a worker stays owned until that worker returns, whatever
``release``, a stop-policy timeout or ``reset`` does. One mechanism: an in-flight object whose worker
may still touch its slots when the cache lets it go moves to ``draining`` (a released or timed-out
prefetch; every prefetch still in flight at a reset, and the backups then in flight as one group,
:class:`DrainedBackups`, since sibling backups share slots) and owns its slots there, each slot once;
``step`` frees them once the worker is agreed finished.

TP contract: what asynchronous progress decides (retiring backups, revoking, stopping, freeing a
drained prefetch's slots) is decided from counts agreed across ranks in the cache's one per-step
collective. The MIN vector is ``[completed backups at the queue head] + [completed pages, finished,
pages found, timed out] per prefetch`` and the MAX vector ``[terminated] per prefetch`` (see
l3_prefetch.py), both in
the order prefetches started (running ones, then draining items), which is identical on every rank.

MLA: the latent KV is the same on every rank, so its pages are named without the rank
(:meth:`HashNamespace.for_spec`) and written by rank 0 alone; every rank reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol

import torch

from tierkv.cache.config import CacheConfig
from tierkv.cache.l3.cost_model import CostModel
from tierkv.cache.records import CacheStats
from tierkv.hashing import HashNamespace, page_hashes
from tierkv.pools.kv import DeviceKVPool, HostKVPool
from tierkv.radix import RadixKey, RadixTree, TreeNode
from tierkv.cache.retire import Retirements
from tierkv.cache.l3.backup import Backup, DrainedBackups
from tierkv.storage.base import PageStore, batch_pages
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import BACKEND_OPTIONS, open_store, parse_spec
from tierkv.cache.l3.pacing import BackupPacer
from tierkv.cache.l3.prefetch import NUM_MAX_COUNTS, NUM_MIN_COUNTS, Prefetch
from tierkv.storage.worker import IOWorker, stop_workers
from tierkv.tp import TPGroup

log = logging.getLogger(__name__)

# Seeds kept per tenant (extra key), least recently used dropped first: one entry per tenant ever
# seen would grow without bound on a multi-tenant server; a dropped seed is recomputed alike.
MAX_CACHED_SEEDS = 4096
# Nodes whose fetched tokens await their first match (see claim_fetched); a bound for nodes never matched.
MAX_FETCHED_UNMATCHED = 4096
MIN_PREFETCH_WAIT_S = 0.002  # an admission wait for a prefetch (before L3 was ever timed): an exists' worth


@dataclass
class StorageStats:
    prefetch_started: int = 0
    prefetch_rate_limited: int = 0
    prefetch_no_room: int = 0
    prefetch_not_worth: int = 0  # the cost model judged even a full hit slower than recomputing it
    prefetch_revoked: int = 0
    prefetch_aborted: int = 0
    prefetched_tokens: int = 0
    backup_started: int = 0
    backup_dropped_tokens: int = 0
    backed_up_tokens: int = 0
    backup_present_tokens: int = 0
    backup_failed_pages: int = 0
    backup_not_worth_tokens: int = 0  # the cost model judged writing them costlier than their reads save


def resolve_namespace(cache: "CacheParts | StorageAttachable", namespace: HashNamespace | str,
                      algorithm: str | None) -> HashNamespace:
    """The namespace of this cache's pages: a string names the model, the rest (KV layout, dtype, shape,
    TP shard) comes from the cache; an explicit namespace must name the cache's own TP shard (MLA: none).
    ``algorithm`` (when given) overrides the namespace's own."""
    spec, tp = cache.device_pool.spec, cache.tp
    if isinstance(namespace, str):
        return HashNamespace.for_spec(namespace, spec, cache.host_pool.layout, tp.rank, tp.world_size,
                                      algorithm=algorithm or "sha256")
    if not isinstance(namespace, HashNamespace):
        raise ValueError(f"namespace must be a HashNamespace or a str, got {namespace!r}")
    # a rank reading under another shard's name would take that shard's heads for its own
    shard = (0, 1) if spec.attention == "mla" else (tp.rank, tp.world_size)
    if (namespace.tp_rank, namespace.tp_size) != shard:
        raise ValueError(f"namespace names TP shard {namespace.tp_rank}of{namespace.tp_size} but this cache "
                         f"is TP rank {tp.rank} of {tp.world_size}, whose {spec.attention} pages are "
                         f"{shard[0]}of{shard[1]}: build it with HashNamespace.for_spec(..., tp_rank, tp_size) "
                         f"or pass the model name as a string")
    return namespace if algorithm is None else dataclasses.replace(namespace, algorithm=algorithm)


@dataclass(frozen=True)
class CacheParts:
    """What the L3 tier works with, handed over by its cache (the controller never sees the cache itself)."""

    tree: RadixTree
    config: CacheConfig
    device_pool: DeviceKVPool
    host_pool: HostKVPool
    tp: TPGroup
    cost_model: CostModel
    stats: CacheStats  # the cache's: L3 hits are counted in storage_hit_tokens
    alloc_host: Callable[[int], torch.Tensor | None]  # L2 slots, evicting from L2 for them


class StorageAttachable(Protocol):
    """A cache that :func:`open_storage` attaches a store to (:class:`tierkv.cache.hicache.HiRadixCache`)."""

    device_pool: DeviceKVPool
    host_pool: HostKVPool | None
    tp: TPGroup
    storage: "StorageController | None"

    def attach_storage(self, store: PageStore, config: StorageConfig, namespace: HashNamespace | str) -> None: ...


def open_storage(cache: StorageAttachable, spec: str, extra_config: str | None,
                 namespace: HashNamespace | str) -> "StorageController":
    """Open the backend ``spec`` names (``file:///dir``, ``redis://host:port/db``, ...) with the backend keys
    of the extra-config JSON, and attach it to ``cache`` with the rest of that JSON as its StorageConfig."""
    backend, _ = parse_spec(spec)
    config = StorageConfig.from_json(extra_config, backend_keys=BACKEND_OPTIONS[backend])
    ns = resolve_namespace(cache, namespace, config.hash_algorithm)
    store = open_store(spec, ns.name(), cache.host_pool.page_nbytes, dict(config.backend_config))
    store.check_config()  # opening is lazy; a refused setting is an error now, not a silent miss later
    cache.attach_storage(store, config, ns)
    return cache.storage


class StorageController:
    """Prefetches and backups of one cache against one page store (see the module docstring)."""

    def __init__(self, cache: CacheParts, store: PageStore, config: StorageConfig,
                 namespace: HashNamespace | str) -> None:
        if cache.host_pool is None:
            raise ValueError("an L3 tier needs the host (L2) tier: enable_host=True")
        if store.page_nbytes != cache.host_pool.page_nbytes:
            raise ValueError(f"store page_nbytes {store.page_nbytes} != host pool page_nbytes "
                             f"{cache.host_pool.page_nbytes}")
        self.cache, self.tree, self.host_pool = cache, cache.tree, cache.host_pool
        self.store, self.config = store, config
        self.namespace = resolve_namespace(cache, namespace, config.hash_algorithm)
        self.page_size = cache.config.page_size
        self.stats = StorageStats()
        self.prefetches: dict[str, Prefetch] = {}  # by request id, in start order: running or revoked
        self.fetched_unmatched: OrderedDict[int, int] = OrderedDict()  # node id -> tokens a prefetch added
        # let go while their worker may still touch their slots
        self.draining: list[Prefetch | DrainedBackups] = []
        self.backups: deque[Backup] = deque()
        self.granted_in_last_step = 0  # prefetches handed host slots by the last apply_progress (agreed)
        self._seed = functools.lru_cache(maxsize=MAX_CACHED_SEEDS)(self.namespace.seed)  # one per tenant, bounded
        tp = cache.tp
        # HiCache's backup_skip: one copy of MLA KV, written by rank 0 (reads still agree across ranks)
        self.skip_backup_writes = cache.device_pool.spec.attention == "mla" and tp.rank != 0
        self.pass_prefix_keys = config.hicache_storage_pass_prefix_keys and store.accepts_prefix_keys
        self.max_tokens_in_flight = config.prefetch_max_tokens_in_flight
        if self.max_tokens_in_flight is None:  # HiCache: room for prefetches is what L2 has beyond L1
            # (L2's size: the host pool less the staging it keeps free for exclusive chunked loads)
            room = cache.host_pool.num_slots - cache.config.staging_tokens - cache.device_pool.num_slots
            self.max_tokens_in_flight = max(int(0.8 * room), cache.config.page_size)
        self.costs = cache.cost_model
        self.backup_batch_pages = batch_pages(store, config.backup_batch_pages, "backup")
        self.prefetch_batch_pages = batch_pages(store, config.prefetch_batch_pages, "prefetch")
        self.costs.batch_pages = self.prefetch_batch_pages
        self._prefetch_worker = IOWorker("tierkv-prefetch")
        self._backup_worker = IOWorker("tierkv-backup")
        self.pacer = BackupPacer()  # an engine marks its forward passes; backups wait for a gap (bounded)

    # ---- hashes -------------------------------------------------------------------------------
    def path_hashes(self, node: TreeNode) -> list[str]:
        """Page hashes of ``node``'s whole path, attaching them to nodes that lack them."""
        hashes: list[str] = []
        for n in self.tree.path_to_root(node):
            if n.hash_values is None:
                prior = hashes[-1] if hashes else self._seed(n.extra_key)
                n.hash_values = page_hashes(n.key, self.page_size, prior, self.namespace)
            hashes.extend(n.hash_values)
        return hashes

    # ---- prefetch -----------------------------------------------------------------------------
    def prefetch(self, request_id: str, last_host_node: TreeNode, key: RadixKey) -> bool:
        """Start prefetching ``key`` beyond ``last_host_node``; see HiRadixCache.prefetch_from_storage.

        Lock contract: one host_ref on ``last_host_node`` (its path), held until the prefetch ends.
        """
        earlier = self.prefetches.get(request_id)
        if earlier is not None and earlier.state == "revoked":  # never checked: nothing left to hand over
            del self.prefetches[request_id]
        elif earlier is not None:
            raise ValueError(f"request {request_id!r} already has a prefetch")
        elems = self.tree.elements(key)
        path = self.tree.path_to_root(last_host_node)
        anchor_len = sum(len(n) for n in path)
        num_tokens = len(elems) - anchor_len
        if num_tokens <= 0 or num_tokens < self.config.prefetch_threshold:
            return False
        # Fetch past the whole match, whichever tier holds its end (HiCache: from the deepest L2 node).
        # Pages of L1-only nodes are freed on arrival anyway, and under write_back (or selective
        # write-through) they never reached L3: a lookup from the L2 node missed its first page and
        # found nothing. A host-only leaf under an L1-only parent is a valid tree (check_integrity).
        anchor = last_host_node
        if self.tokens_in_flight >= self.max_tokens_in_flight:  # HiCache: full already, whatever this one's size
            self.stats.prefetch_rate_limited += 1
            return False
        if not self.costs.l3_may_pay(anchor_len, num_tokens // self.page_size, self.page_size):
            self.stats.prefetch_not_worth += 1
            return False
        # the anchor's hashes (kept on its nodes) and the seed before anything is taken; the pages past the
        # anchor are hashed by the worker as its lookup reaches them (HiCache's prefetch thread hashes too)
        anchor_hashes = self.path_hashes(anchor) if path else []
        prior = anchor_hashes[-1] if anchor_hashes else self._seed(key.extra_key)
        # host slots come later (_grant), for the pages L3 holds: L2 eviction must not take the anchor meanwhile
        self.tree.inc_host_ref(anchor)
        config, ps = self.config, self.page_size
        hash_pages = partial(page_hashes, page_size=ps, namespace=self.namespace)
        prefetch = Prefetch(request_id, anchor, anchor_len, key, elems[anchor_len:], prior, hash_pages,
                            config.prefetch_timeout_base, config.prefetch_timeout_per_ki_token * ps / 1024,
                            min_found_pages=-(-config.prefetch_threshold // ps),
                            prefix_hashes=anchor_hashes if self.pass_prefix_keys else None,
                            page_size=ps, costs=self.costs, stall_timeout_s=self._stall_timeout_s())
        self.prefetches[request_id] = prefetch
        self._prefetch_worker.submit(partial(prefetch.lookup, self.store))
        self.stats.prefetch_started += 1
        return True

    def _stall_timeout_s(self) -> float | None:
        """``wait_complete`` has no time budget (HiCache): it gives up only on a store that makes no
        progress for ``io_wait_timeout_s``, the bound of every other wait on a storage thread."""
        return self.config.io_wait_timeout_s if self.config.prefetch_stop_policy == "wait_complete" else None

    @property
    def tokens_in_flight(self) -> int:
        """Tokens asked for by the prefetches not yet ended, however many L3 turned out to hold: the rate
        limit's measure (HiCache's ``prefetch_tokens_occupied``)."""
        return sum(p.num_pages for p in self.prefetches.values() if p.state == "running") * self.page_size

    def check_prefetch(self, request_id: str) -> bool:
        """See HiRadixCache.check_prefetch_progress. Lock contract: on ending, releases the host_ref."""
        prefetch = self.prefetches.get(request_id)
        if prefetch is None:
            return True
        if prefetch.state == "revoked":
            del self.prefetches[request_id]
            return True
        if not prefetch.may_stop(self.config.prefetch_stop_policy):
            return False
        del self.prefetches[request_id]
        self._end(prefetch, keep_pages=prefetch.agreed_pages)
        return True

    def wait_prefetch(self, request_id: str, max_wait_s: float) -> None:
        """Wait for the request's running prefetch worker, at most its expected time (cost model) and
        ``max_wait_s``; the cache's next step agrees what it did. Lock contract: takes none."""
        prefetch = self.prefetches.get(request_id)
        if prefetch is not None and prefetch.state == "running":
            # before the grant the worker has only its exists call to make; after it, the granted reads
            num_pages = len(prefetch.host_pages) if prefetch.granted.is_set() else 0
            expected_s = self.costs.expected_fetch_s(num_pages, self.page_size)
            prefetch.wait_worker(min(max_wait_s, max(2 * expected_s, MIN_PREFETCH_WAIT_S)))

    def prefetch_phase(self, request_id: str) -> str | None:
        """``lookup`` (exists running, or its count not yet agreed), ``reading`` (slots granted), or None
        when the request has no running prefetch. Agreed state: alike on every TP rank."""
        prefetch = self.prefetches.get(request_id)
        if prefetch is None or prefetch.state != "running":
            return None
        return "reading" if prefetch.granted.is_set() else "lookup"

    def release(self, request_id: str) -> None:
        """See HiRadixCache.release_prefetch. Lock contract: releases the host_ref of a running prefetch."""
        prefetch = self.prefetches.pop(request_id, None)
        if prefetch is not None and prefetch.state == "running":
            self.stats.prefetch_aborted += 1
            self._end(prefetch, keep_pages=0)

    def _end(self, prefetch: Prefetch, keep_pages: int) -> None:
        """Insert the first ``keep_pages`` pages, drop the anchor's host_ref, free or drain the rest."""
        prefetch.cancel.set()
        keep_tokens = keep_pages * self.page_size
        try:
            if keep_tokens:
                new_tokens = self._insert(prefetch, keep_tokens)  # pages the tree already had are no L3 hit
                self.cache.stats.storage_hit_tokens += new_tokens
                self.stats.prefetched_tokens += new_tokens
        except Exception:
            self._free_unadopted(prefetch.host_slots[:keep_tokens])
            raise
        finally:  # even if the insert failed: the anchor must not stay protected, nor the rest be lost
            self._release_rest(prefetch, keep_tokens)

    def claim_fetched(self, nodes: list[TreeNode]) -> int:
        """How many tokens of ``nodes`` (a match's host part) a prefetch added since they were last matched;
        forgets them, so each fetched token counts as one hit, in L3. Lock contract: takes no lock."""
        if not self.fetched_unmatched:
            return 0
        return sum(self.fetched_unmatched.pop(node.id, 0) for node in nodes)

    def _free_unadopted(self, slots: torch.Tensor) -> None:
        """After a failed insert: free the pages of ``slots`` that no node took and that are not freed
        yet (a full scan of the tree, on this failure path only)."""
        held = [n.host_value for n in self.tree.nodes() if n.host_value is not None]
        adopted = torch.isin(slots, torch.cat(held)) if held else torch.zeros(len(slots), dtype=torch.bool)
        allocated = self.host_pool.allocator.owned_mask().repeat_interleave(self.page_size)[slots]
        self.host_pool.free(slots[allocated & ~adopted])

    def _release_rest(self, prefetch: Prefetch, keep_tokens: int) -> None:
        self.tree.dec_host_ref(prefetch.anchor)
        rest = prefetch.host_slots[keep_tokens:]
        if prefetch.agreed_finished or not prefetch.granted.is_set():  # no read job ever owned slots
            self.host_pool.free(rest)
            prefetch.state = "done"
        else:  # the worker may still write into them: keep them until it is agreed finished
            prefetch.host_slots, prefetch.state = rest, "draining"
            self.draining.append(prefetch)

    def _insert(self, prefetch: Prefetch, num_tokens: int) -> int:
        """Hang the fetched pages under the anchor as host-only nodes; the tokens new to the tree.

        As HiCache: pages of nodes the tree already has below the anchor are freed, whichever tier holds
        them (a node only in L1 keeps no L2 copy from a prefetch: exclusive tiers never hold a page
        twice); the walk refreshes the anchor and the nodes below it, not the anchor's ancestors.
        """
        end = prefetch.anchor_len + num_tokens
        key = prefetch.key
        # an array('q') slice is a copy the key adopts (a list of the prompt's ints, packed back into an
        # array, cost ~0.15 ms a prefetch: 0.3 CPU-s of a 2,000-request replay with a file L3)
        cut = RadixKey(key.token_ids[: end + (1 if self.tree.bigram else 0)], key.extra_key)
        path = self.tree.match(cut, touch=False)
        slots = prefetch.host_slots[:num_tokens]
        ps, start, parent = self.page_size, 0, self.tree.root
        walked = [] if prefetch.anchor is self.tree.root else [prefetch.anchor]
        for node in path.nodes:
            if start >= prefetch.anchor_len:
                walked.append(node)
            start += len(node)
            parent = node
        self.tree.touch(walked)
        offset = path.num_tokens - prefetch.anchor_len
        if offset > 0:
            self.host_pool.free(slots[:offset])
        if offset < num_tokens:
            elems = self.tree.elements(cut)
            leaf = self.tree.add_leaf(parent, elems[path.num_tokens:], key.extra_key)
            leaf.host_value = slots[offset:]
            leaf.hash_values = prefetch.hashes[offset // ps: num_tokens // ps]
            leaf.in_storage = True  # read from L3: no backup needs to write it again
            # counted as L3 hits now; the next match must not count them as L2 hits too (claim_fetched)
            self.fetched_unmatched[leaf.id] = num_tokens - offset
            while len(self.fetched_unmatched) > MAX_FETCHED_UNMATCHED:  # never matched: forget the oldest
                self.fetched_unmatched.popitem(last=False)
            return num_tokens - offset
        return 0

    def _counted(self) -> list[Prefetch | DrainedBackups]:
        return [p for p in self.prefetches.values() if p.state == "running"] + self.draining

    # ---- backup -------------------------------------------------------------------------------
    def backup(self, node: TreeNode) -> None:
        """Write the pages of ``node``'s path that L2 holds, from the last node of it L2 lacks down to
        ``node``, to L3 in the background (an ancestor only in L1 is backed up when written back in turn;
        chained hashes name each page's whole prefix), unless the cost model judges the write costlier
        than its expected reads save. Lock contract: host_ref on ``node`` until retired."""
        path = self.tree.path_to_root(node)
        if not path or node.host_value is None:
            return
        start = len(path) - 1
        while start > 0 and path[start - 1].host_value is not None:
            start -= 1
        hashes = self.path_hashes(node)
        above = sum(len(n) for n in path[:start]) // self.page_size  # pages of the prefix not written
        num_pages = self._pages_to_write(path[start:], above, len(hashes) - above)
        if num_pages is None:
            return
        slots = torch.cat([n.host_value for n in path[start:]])[: num_pages * self.page_size]
        self.tree.inc_host_ref(node)
        self._start_backup(Backup(node, hashes[above: above + num_pages], [], slots, self.page_size,
                                  prefix_hashes=hashes[:above] if self.pass_prefix_keys else None))

    def plan_copied_backup(self, node: TreeNode) -> Backup | None:
        """Exclusive tiers, whose L2 holds no copy of what L1 holds: a backup (not started, no slots yet) of
        the leading pages worth writing of ``node``'s path below its deepest node already backed up
        (``in_storage``); None when there is nothing to write. The caller copies its pages from L1 (the
        first ``num_tokens`` tokens of ``copied_nodes``) into host slots of its own and hands it to
        :meth:`backup_copied`. Lock contract: takes no lock."""
        path = self.tree.path_to_root(node)
        start = len(path)
        while start > 0 and not path[start - 1].in_storage:
            start -= 1
        if start == len(path):
            return None
        hashes = self.path_hashes(node)
        above = sum(len(n) for n in path[:start]) // self.page_size
        num_pages = self._pages_to_write(path[start:], above, len(hashes) - above)
        if not num_pages:  # dropped or not worth it (the same on every rank: no cost model under TP)
            return None
        return Backup(node, hashes[above: above + num_pages], [], torch.empty(0, dtype=torch.int64),
                      self.page_size, prefix_hashes=hashes[:above] if self.pass_prefix_keys else None,
                      owns_slots=True, copied_nodes=path[start:])

    def backup_copied(self, backup: Backup, host_slots: torch.Tensor) -> None:
        """Start ``backup`` (:meth:`plan_copied_backup`) from ``host_slots``, where its pages were copied from
        L1; it owns them and frees them when retired, so L2 keeps no copy. Lock contract: takes no lock."""
        backup.host_slots, backup.copied_nodes = host_slots, []
        self._start_backup(backup)

    def _pages_to_write(self, nodes: list[TreeNode], above: int, num_pages: int) -> int | None:
        """Of ``num_pages`` pages after the ``above`` pages of the prefix, the leading ones to back up: all,
        fewer when the cost model judges writing them costlier than their reads save; None (dropped)
        when the backups in flight are at their bound. ``nodes`` count as backed up from now on either way."""
        for n in nodes:
            n.in_storage = True
        pending = sum(b.num_tokens for b in self.backups)
        if pending + num_pages * self.page_size > self.config.backup_max_pending_tokens:
            self.stats.backup_dropped_tokens += num_pages * self.page_size
            return None
        if self.skip_backup_writes:  # MLA: rank 0 writes the one copy
            return num_pages
        wanted = self.costs.backup_pages(above * self.page_size, num_pages, self.page_size)
        self.stats.backup_not_worth_tokens += (num_pages - wanted) * self.page_size
        return wanted

    def _start_backup(self, backup: Backup) -> None:
        backup.host_pages = self.host_pool.allocator.slots_to_pages(backup.host_slots).tolist()
        backup.costs = self.costs
        self.backups.append(backup)
        self.stats.backup_started += 1
        if self.skip_backup_writes or not backup.hashes:  # queued done
            backup.done.set()
            return
        self._backup_worker.submit(self.pacer.paced(partial(backup.run, self.store, self.host_pool,
                                                            self.backup_batch_pages)))

    def _retire_backup(self, backup: Backup) -> None:
        if backup.owns_slots:
            self.host_pool.free(backup.host_slots)
        else:
            self.tree.dec_host_ref(backup.node)
        self.stats.backed_up_tokens += backup.written_pages * self.page_size
        self.stats.backup_present_tokens += backup.skipped_pages * self.page_size
        self.stats.backup_failed_pages += backup.failed_pages

    # ---- progress (TP agreement) --------------------------------------------------------------
    def local_progress(self) -> tuple[list[int], list[int]]:
        """This rank's MIN and MAX counts, in the order described in the module docstring."""
        done = 0
        for backup in self.backups:
            if not backup.done.is_set():
                break
            done += 1
        min_counts, max_counts = [done], []
        for prefetch in self._counted():
            mins, maxs = prefetch.local_counts()
            min_counts += mins
            max_counts += maxs
        return min_counts, max_counts

    def apply_progress(self, min_counts: list[int], max_counts: list[int]) -> None:
        """Act on agreed counts. Lock contract: releases host_refs of retired backups and revoked prefetches.

        Each item is retired on its own: one that raises strands no other; the first error is
        raised once all are done.
        """
        counted = self._counted()
        if len(min_counts) != 1 + NUM_MIN_COUNTS * len(counted) or \
                len(max_counts) != NUM_MAX_COUNTS * len(counted):
            raise ValueError(f"{len(min_counts)} MIN and {len(max_counts)} MAX progress counts for "
                             f"{len(counted)} prefetches")
        retirements = Retirements()
        self.granted_in_last_step = 0
        for _ in range(min_counts[0]):
            backup = self.backups.popleft()
            backup.done.wait()
            retirements.run(self._retire_backup, backup)
        for i, item in enumerate(counted):
            item.agree(min_counts[1 + NUM_MIN_COUNTS * i: 1 + NUM_MIN_COUNTS * (i + 1)],
                       max_counts[NUM_MAX_COUNTS * i: NUM_MAX_COUNTS * (i + 1)])
        for prefetch in [p for p in counted if p.state == "running"]:  # draining backups are never running
            if prefetch.awaits_grant:
                retirements.run(self._grant, prefetch)
            elif prefetch.agreed_finished and prefetch.agreed_pages == 0:
                retirements.run(self._revoke, prefetch)
        for item in [d for d in self.draining if d.agreed_finished]:
            self.draining.remove(item)  # first: a failing free must not be retried on a later step
            retirements.run(self._retire_drained, item)
        retirements.raise_first()

    def _retire_drained(self, item: Prefetch | DrainedBackups) -> None:
        """Its worker has returned: the slots it owned go back to the pool."""
        item.state = "done"
        self.host_pool.free(item.host_slots)

    def _grant(self, prefetch: Prefetch) -> None:
        """The pages found are agreed: take host slots for those alone (evicting L2 only for them) and
        let the worker read; nothing found, or no room, revokes it having taken nothing."""
        num_tokens = min(prefetch.agreed_found, prefetch.num_pages) * self.page_size
        host_slots = self.cache.alloc_host(num_tokens) if num_tokens else None
        if host_slots is None:
            self.stats.prefetch_no_room += int(num_tokens > 0)
            self._revoke(prefetch)
            return
        prefetch.grant(host_slots, self.host_pool.allocator.slots_to_pages(host_slots).tolist())
        self.granted_in_last_step += 1
        self._prefetch_worker.submit(partial(prefetch.read, self.store, self.host_pool,
                                             self.prefetch_batch_pages))

    def _revoke(self, prefetch: Prefetch) -> None:
        """Nothing (worth reading) was found, no room for it, or the first read failed: give back what
        it holds now; the request proceeds without waiting."""
        prefetch.cancel.set()
        self.tree.dec_host_ref(prefetch.anchor)
        self.host_pool.free(prefetch.host_slots)
        prefetch.host_slots = prefetch.host_slots[:0]
        prefetch.state = "revoked"
        self.stats.prefetch_revoked += 1

    # ---- maintenance --------------------------------------------------------------------------
    def owned_host_slots(self) -> list[torch.Tensor]:
        """Host slots held by running prefetches, backups of pages copied for them and draining items (the
        tree owns everything else)."""
        return [p.host_slots for p in self._counted()] + [b.host_slots for b in self.backups if b.owns_slots]

    @property
    def pins_host_pages(self) -> bool:
        """Whether backups, prefetches or draining items hold or protect L2 pages now."""
        return bool(self.backups) or bool(self._counted())

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every backup is written and every prefetch's worker is done; False on timeout."""
        deadline = time.monotonic() + (self.config.io_wait_timeout_s if timeout_s is None else timeout_s)
        waits = [b.done.wait for b in self.backups] + [p.wait_worker for p in self._counted()]
        for wait in waits:
            if not wait(max(0.0, deadline - time.monotonic())):
                log.warning("storage I/O still running after %.1f s; not waiting longer",
                            self.config.io_wait_timeout_s)
                return False
        return True

    def flush(self) -> None:
        """Wait (bounded by io_wait_timeout_s) for in-flight I/O; the cache's next step retires it."""
        self.wait_idle()

    def clear_store(self) -> bool:
        """Empty the store after in-flight backups (bounded wait: they would re-add pages); False when
        the backend cannot clear or fails to (raises, or counts an error meanwhile), as HiCache's."""
        self.wait_idle()
        errors_before = self.store.stats.errors
        try:
            self.store.clear()
        except NotImplementedError:
            return False
        except Exception as exc:  # a backend fault is a False answer, never a crash of the caller
            log.error("clearing L3 failed: %s: %s", type(exc).__name__, exc)
            return False
        return self.store.stats.errors == errors_before

    def reset(self, clear_store: bool = False) -> None:
        """Cancel in-flight work; what is still in flight after a bounded wait drains, owning its host
        slots (see :meth:`owned_host_slots`) until its worker returns. Call before the cache resets its
        tree and pools. Empties the store if asked."""
        for item in [*self.prefetches.values(), *self.backups]:  # draining items are cancelled already
            item.cancel.set()
        self.wait_idle()
        running = [p for p in self.prefetches.values() if p.state == "running"]
        for prefetch in running:
            if not prefetch.granted.is_set():  # its lookup owns no slot: nothing to drain
                prefetch.state = "done"
        for prefetch in [p for p in running if p.state == "running"]:
            prefetch.state = "draining"
            self.draining.append(prefetch)
        if self.backups:  # one owner for their slots: sibling backups share their prefix's
            self.draining.append(DrainedBackups.of(list(self.backups)))
        self.prefetches.clear()
        self.backups.clear()
        if clear_store:
            self.store.clear()
        self.stats = StorageStats()

    def close(self) -> None:
        """Stop the worker threads (bounded wait) and close the store."""
        for prefetch in self.prefetches.values():  # draining items are cancelled already
            prefetch.cancel.set()
        stopped = stop_workers([self._prefetch_worker, self._backup_worker], self.config.io_wait_timeout_s)
        if stopped:
            self.store.close()
