"""A prefetch from L3 into L2 in flight: one object owning its host slots, hashes and completion state.

Order of work: the worker first asks the store which leading pages it holds (``exists``, in growing
batches, each batch's page hashes made just before it is asked for, as HiCache's prefetch thread does: a
lookup that misses early hashes no more of the prompt, and the scheduler thread hashes none of it), cut to the
pages worth reading (the cost model, ``min_found_pages``); that count is agreed; only then does the
scheduler thread take host slots, for the agreed pages alone (evicting L2 only for those; see
:meth:`tierkv.cache.l3.controller.StorageController.apply_progress`), and hand them over (``granted``); the
worker then reads into them. A prefetch whose L3 holds nothing takes no host slot and evicts nothing.

The worker fills host pages in order and only ever raises ``completed_pages``, then sets ``finished``.
The scheduler thread sees that progress only through agreed counts (see :meth:`Prefetch.local_counts`
/ :meth:`Prefetch.agree`), so every TP rank decides alike. Two kinds of counts travel in the one
per-step agreement:

- MIN fields: a rank inserts only the pages every rank has, a prefetch is finished when it is finished
  everywhere, and the pages to read are the leading run that *every* rank's L3 holds (and finds worth
  reading): a rank whose L3 holds all 8 pages does not read 8 when another holds 3. "Timed out" is one
  too: the budget stops a prefetch once it has passed on every rank (HiCache's rule: stop when every
  rank can stop), not when the first rank's passes.
- MAX fields: "terminated" (this rank's reads failed short). Terminated anywhere means terminated
  everywhere: no rank waits for pages that another rank can never contribute.

Every count only grows, so a step that agrees on zeros (a rank with no news) changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tierkv.cache.l3.cost_model import CostModel
from tierkv.pools.kv import HostKVPool
from tierkv.radix import RadixKey, TreeNode
from tierkv.storage.base import PageStore, prefix_keys_arg, takes_rows

log = logging.getLogger(__name__)

# per prefetch in the progress vectors: MIN (completed pages, finished, 1 + pages found, timed out), MAX
# (terminated).
# "Found" travels as 1 + pages so that 0 stays the neutral "no news yet" of every field.
NUM_MIN_COUNTS = 4
NUM_MAX_COUNTS = 1
_FOUND_UNKNOWN = -1
_NO_SLOTS = torch.empty(0, dtype=torch.int64)
# pages in a lookup's first exists batch; each next batch is twice the last (a hit of 10,000 pages: 10 calls)
FIRST_LOOKUP_PAGES = 16


@dataclass(eq=False)
class Prefetch:
    """The ``num_pages`` whole pages of ``tokens`` (the key's elements beyond ``anchor``, which starts
    ``anchor_len`` elements in) into ``host_slots``. Their page hashes (``hashes``) are made by the worker as
    its lookup reaches them, continuing the chain from ``prior_hash`` (the anchor's last page hash, or the
    namespace's seed) with ``hash_pages(tokens, prior_hash=...)``; the scheduler thread reads only those of pages
    found, once the lookup has published its count.

    While running it holds one host_ref on ``anchor``. ``state`` moves running -> done, or running ->
    revoked (nothing worth reading found), or running -> draining (ended while the worker may still
    write into the slots it kept; they are freed once the worker is agreed finished). ``host_slots``
    stay empty until the scheduler grants slots for the agreed pages found (:meth:`grant`); the worker
    waits for that after ``exists`` and reads only the granted pages. A run under ``min_found_pages``
    counts as nothing found. The timeout budget is ``timeout_base_s`` plus ``timeout_per_page_s`` per
    page found (agreed), HiCache's rule; with ``stall_timeout_s`` set (the ``wait_complete`` policy) there
    is no budget, as in HiCache, and the prefetch times out only once ``stall_timeout_s`` has passed
    since its last progress (a store call returned, slots were granted): a store that hangs, not one
    that is merely slow. ``costs`` (the cache's cost model) gets every call's time and
    cuts the pages found to those cheaper to fetch than to recompute; the rest are recomputed.
    """

    request_id: str
    anchor: TreeNode
    anchor_len: int
    key: RadixKey
    tokens: Sequence
    prior_hash: str
    hash_pages: Callable[..., list[str]]  # (tokens, prior_hash=...) -> their whole pages' hashes
    timeout_base_s: float
    timeout_per_page_s: float
    page_size: int = 1
    hashes: list[str] = field(default_factory=list)  # the leading pages' hashes made so far (worker thread)
    host_slots: torch.Tensor = _NO_SLOTS  # granted by the scheduler once the pages found are agreed
    host_pages: list[int] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)
    stall_timeout_s: float | None = None  # set: no budget, only a bound on no progress (wait_complete)
    progress_s: float = field(default_factory=time.monotonic)  # the last progress (either thread writes it)
    state: str = "running"
    min_found_pages: int = 0
    prefix_hashes: list[str] | None = None  # the anchor path's page hashes, for stores that want them
    costs: CostModel | None = None  # times every call; cuts the read to what beats recomputing
    # written by the worker thread only; found_pages: the leading run present and worth reading
    found_pages: int = 0
    completed_pages: int = 0
    failed: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    exists_done: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # agreed across ranks; scheduler thread only (``granted`` is how the worker learns its host pages)
    agreed_pages: int = 0
    agreed_finished: bool = False
    agreed_found: int = _FOUND_UNKNOWN
    agreed_terminated: bool = False
    agreed_timed_out: bool = False
    granted: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.num_pages = len(self.tokens) // self.page_size

    @property
    def awaits_grant(self) -> bool:
        """Running, the pages found agreed, no slots granted yet: the scheduler's move (see :meth:`grant`)."""
        return self.state == "running" and self.agreed_found != _FOUND_UNKNOWN and not self.granted.is_set()

    def grant(self, host_slots: torch.Tensor, host_pages: list[int]) -> None:
        """Scheduler thread: the slots for the agreed pages found; the caller then submits :meth:`read`."""
        self.host_slots, self.host_pages = host_slots, host_pages
        self.progress_s = time.monotonic()
        self.granted.set()

    def local_counts(self) -> tuple[list[int], list[int]]:
        """This rank's progress: MIN fields (completed pages, finished, 1 + pages found, timed out), MAX
        (terminated)."""
        finished = self.finished.is_set()  # read first: once set, completed_pages and failed are final
        found = 1 + self.found_pages if self.exists_done.is_set() else 0
        if self.stall_timeout_s is None:
            timed_out = time.monotonic() - self.started_s >= self.budget_s
        else:  # a finished rank times out too, stall_timeout_s after its end: the MIN waits for the others
            timed_out = time.monotonic() - self.progress_s >= self.stall_timeout_s
        return [self.completed_pages, int(finished), found, int(timed_out)], [int(finished and self.failed)]

    @property
    def budget_s(self) -> float:
        """The timeout policy's budget: grows with the pages L3 holds, once agreed (base until then)."""
        return self.timeout_base_s + self.timeout_per_page_s * max(self.agreed_found, 0)

    def agree(self, min_counts: list[int], max_counts: list[int]) -> None:
        """Record counts agreed across ranks (MIN fields, MAX fields; see the module docstring)."""
        self.agreed_pages = max(self.agreed_pages, min(min_counts[0], self.num_pages))
        self.agreed_finished = self.agreed_finished or bool(min_counts[1])
        if self.agreed_found == _FOUND_UNKNOWN and min_counts[2] > 0:
            self.agreed_found = min_counts[2] - 1  # the controller grants slots for it (awaits_grant)
        self.agreed_timed_out = self.agreed_timed_out or bool(min_counts[3])
        self.agreed_terminated = self.agreed_terminated or bool(max_counts[0])

    def may_stop(self, policy: str) -> bool:
        """Whether the stop policy lets the request go now (from agreed state only).

        Terminated anywhere (a rank's reads failed short) stops every policy: the pages every rank
        holds can no longer grow past what the agreed count already says. So does the budget, once it
        has passed on every rank.
        """
        if policy == "best_effort" or self.agreed_terminated or self.agreed_timed_out:
            return True
        return self.agreed_finished

    def wait_worker(self, timeout_s: float) -> bool:
        """Wait until the worker is done, or its lookup found pages that wait for a step to agree their
        count and grant their slots (waiting longer could only stall: that needs the caller's next step).
        Scheduler thread (it alone grants)."""
        deadline = time.monotonic() + timeout_s
        if not self.exists_done.wait(timeout_s):
            return False
        if self.found_pages and not self.granted.is_set():
            return True
        return self.finished.wait(max(0.0, deadline - time.monotonic()))

    # ---- worker thread ------------------------------------------------------------------------
    def _prefix_keys(self, start: int) -> dict[str, list[str]]:
        return prefix_keys_arg(self.prefix_hashes, self.hashes, start)

    def lookup(self, store: PageStore) -> None:
        """The first job: how many leading pages the store holds that are worth reading. Finished here
        when none are (nothing agreed then: a MIN); otherwise the scheduler grants slots and submits
        :meth:`read`."""
        try:
            present = self._present(store)
            if not self.cancel.is_set():
                usable = present if present >= max(1, self.min_found_pages) else 0
                if self.costs is not None:
                    self.costs.observe_l3_lookup(self.num_pages, usable)
                self.found_pages = self._worth_reading(usable)
        except Exception as exc:  # a failing backend finds nothing, never a crash
            self.failed = True
            log.warning("prefetch %s: storage lookup failed: %s: %s", self.request_id, type(exc).__name__, exc)
        finally:  # a failed exists finds 0 pages: the other ranks must not wait for this one
            self.progress_s = time.monotonic()
            self.exists_done.set()
            if not self.found_pages or self.cancel.is_set():  # no read will follow
                self.finished.set()

    def _present(self, store: PageStore) -> int:
        """The leading run of pages the store holds, asked for in batches of 16, 32, 64, ... pages up to the
        first batch not wholly present, each batch hashed just before it is asked for."""
        present, size = 0, FIRST_LOOKUP_PAGES
        while present < self.num_pages and not self.cancel.is_set():
            end = min(self.num_pages, present + size)
            self._hash_through(end)
            started_s = time.perf_counter()
            held = store.batch_exists(self.hashes[present:end], **self._prefix_keys(present))
            if self.costs is not None:
                self.costs.observe_l3_exists(time.perf_counter() - started_s)
            if held < end - present:
                return present + max(0, held)
            present, size = end, size * 2
        return present

    def _hash_through(self, end: int) -> None:
        """Make the hashes of pages up to ``end`` (exclusive), continuing the chain."""
        start, ps = len(self.hashes), self.page_size
        if end > start:
            prior = self.hashes[-1] if self.hashes else self.prior_hash
            self.hashes += self.hash_pages(self.tokens[start * ps:end * ps], prior_hash=prior)

    def read(self, store: PageStore, host_pool: HostKVPool, batch_pages: int) -> None:
        """The second job, once granted: read the granted pages into their host slots, batch by batch."""
        num_pages = len(self.host_pages)
        try:
            for start in range(0, num_pages, batch_pages):
                if self.cancel.is_set():
                    return
                if not self._read(store, host_pool, start, min(num_pages, start + batch_pages)):
                    self.failed = True
                    return
        except Exception as exc:  # a failing backend means fewer pages, never a crash
            self.failed = True
            log.warning("prefetch %s: storage failed after %d pages: %s: %s", self.request_id,
                        self.completed_pages, type(exc).__name__, exc)
        finally:
            self.finished.set()

    def _worth_reading(self, usable: int) -> int:
        """Of the ``usable`` leading pages (0 when under ``min_found_pages``), those worth reading: the
        cost model's cut (ranks may cut differently: the agreed MIN of the cuts is read)."""
        if not usable or self.costs is None:
            return usable
        return self.costs.l3_pages_to_fetch(self.anchor_len, usable, self.page_size)

    def _read(self, store: PageStore, host_pool: HostKVPool, start: int, end: int) -> bool:
        pages, keys, prefix = self.host_pages[start:end], self.hashes[start:end], self._prefix_keys(start)
        # page-first layouts: a page store writes the pool's rows in place; otherwise a tensor a page
        # (a view of the pool where the layout has one, a staging copy where not)
        rows = host_pool.page_bytes_array() if takes_rows(store) else None
        direct = [] if rows is not None else [host_pool.page_bytes(p) for p in pages]
        targets = [d if d is not None else torch.empty(host_pool.page_nbytes, dtype=torch.uint8) for d in direct]
        started_s = time.perf_counter()
        if rows is not None:
            ok = store.batch_get_rows(keys, rows, pages, **prefix)
        else:
            ok = store.batch_get(keys, targets, **prefix)
        if self.costs is not None:
            self.costs.observe_l3_get(time.perf_counter() - started_s, end - start)
        num_ok = ok.index(False) if False in ok else len(ok)  # a missing or corrupt page ends the usable prefix
        for page, view, target in zip(pages[:num_ok], direct, targets):
            if view is None:
                host_pool.write_page(page, target)
        self.completed_pages = start + num_ok
        self.progress_s = time.monotonic()
        return num_ok == len(ok)
