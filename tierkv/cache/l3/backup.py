"""A backup from L2 to L3 in flight: the L2 pages of one node's path, protected in L2 until acknowledged."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.cache.l3.cost_model import CostModel
from tierkv.pools.kv import HostKVPool
from tierkv.radix import TreeNode
from tierkv.storage.base import PageStore, prefix_keys_arg, takes_rows

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Backup:
    """Writes ``hashes`` from ``host_pages``; holds one host_ref on ``node`` until the controller retires it
    (unless ``owns_slots``).

    ``host_slots`` are the slots of ``host_pages``. The tree owns them, never the backup (backups of
    sibling prompts share their common prefix's slots), except for ``owns_slots``: pages copied from L1
    for this backup alone. When a reset drops the tree under backups still in flight, one
    :class:`DrainedBackups` takes those slots over (see there).

    Pages already present at the head (batch_exists) are skipped. Only ``done`` and the page counts are
    written by the worker thread. ``costs`` (the cache's cost model) gets the thread's CPU per page written.
    """

    node: TreeNode
    hashes: list[str]
    host_pages: list[int]
    host_slots: torch.Tensor
    page_size: int
    done: threading.Event = field(default_factory=threading.Event)
    cancel: threading.Event = field(default_factory=threading.Event)
    skipped_pages: int = 0
    written_pages: int = 0
    failed_pages: int = 0
    # for a store that wants each batch's prefix keys: the page hashes of the path above ``hashes``
    prefix_hashes: list[str] | None = None
    costs: CostModel | None = None
    # exclusive tiers: the pages were copied from L1 into slots this backup owns (freed when it retires;
    # no host_ref on ``node``); ``copied_nodes`` are the nodes to copy them from, until the copy is made
    owns_slots: bool = False
    copied_nodes: list[TreeNode] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.page_size

    def _prefix_keys(self, start: int) -> dict[str, list[str]]:
        return prefix_keys_arg(self.prefix_hashes, self.hashes, start)

    def run(self, store: PageStore, host_pool: HostKVPool, batch_pages: int) -> None:
        """Skip the leading run already stored and write the rest (host-pool page views where possible)."""
        started_cpu_s = time.thread_time()
        try:
            self.skipped_pages = store.batch_exists(self.hashes, **self._prefix_keys(0))
            # page-first layouts: the store reads the pool's rows in place
            rows = host_pool.page_bytes_array() if takes_rows(store) else None
            digests = host_pool.digests if rows is not None and store.accepts_digests else None
            if digests is not None:  # later L1 -> L2 copies hash what they write (see PageDigests)
                digests.enable()
            for start in range(self.skipped_pages, len(self.hashes), batch_pages):
                if self.cancel.is_set():  # the cache was reset: these pages are no longer wanted
                    return
                end = min(len(self.hashes), start + batch_pages)
                keys, prefix = self.hashes[start:end], self._prefix_keys(start)
                if rows is not None:
                    pages = self.host_pages[start:end]
                    extra: dict[str, Any] = dict(prefix)
                    if digests is not None:  # read before the store reads the pages (see PageDigests)
                        extra["digests"] = digests.lookup(pages)
                    ok = store.batch_set_rows(keys, rows, pages, **extra)
                else:
                    values = [host_pool.read_page(p) for p in self.host_pages[start:end]]
                    ok = store.batch_set(keys, values, **prefix)
                self.written_pages += sum(ok)
                self.failed_pages += len(ok) - sum(ok)
        except Exception as exc:  # L3 is a cache: a failed backup only costs a future miss
            log.warning("backup of node %d failed: %s: %s", self.node.id, type(exc).__name__, exc)
            self.failed_pages = len(self.hashes) - self.skipped_pages - self.written_pages
        finally:
            if self.costs is not None:
                self.costs.observe_l3_write(time.thread_time() - started_cpu_s, self.written_pages)
            self.done.set()


@dataclass(eq=False)
class DrainedBackups:
    """The backups still in flight when the cache was reset, owning their host slots until every one of
    their workers has returned (a worker may still read them).

    One owner for all of them: sibling backups cover their shared prefix's slots, so each backup owning
    its own slots would own those twice and free them twice (the second time under whichever node had
    reused them). ``host_slots`` holds each slot once. It drains like a prefetch.
    """

    backups: list[Backup]
    host_slots: torch.Tensor
    state: str = "draining"
    agreed_finished: bool = False  # scheduler thread only

    @classmethod
    def of(cls, backups: list[Backup]) -> "DrainedBackups":
        return cls(backups, torch.unique(torch.cat([b.host_slots for b in backups])))

    def local_counts(self) -> tuple[list[int], list[int]]:
        """In a prefetch's progress layout: MIN [0, finished, 0, 0], MAX [0]."""
        return [0, int(all(b.done.is_set() for b in self.backups)), 0, 0], [0]

    def agree(self, min_counts: list[int], max_counts: list[int]) -> None:
        self.agreed_finished = self.agreed_finished or bool(min_counts[1])

    def wait_worker(self, timeout_s: float) -> bool:
        """Wait until every worker has returned; False on timeout."""
        deadline = time.monotonic() + timeout_s
        return all(b.done.wait(max(0.0, deadline - time.monotonic())) for b in self.backups)
