"""A prefetch from L3 into L2 in flight: one object owning its host slots, hashes and completion state.

The worker thread fills host pages in order and only ever raises ``completed_pages``, then sets
``finished``. The scheduler thread sees that progress only through agreed counts (see
:meth:`Prefetch.local_counts` / :meth:`Prefetch.agree`), so every TP rank decides alike. Two kinds of
counts travel in the one per-step agreement:

- MIN fields: a rank inserts only the pages every rank has, a prefetch is finished when it is finished
  everywhere, and the pages to read are the leading run that *every* rank's L3 holds (with several
  ranks the worker waits after ``exists`` until that count is agreed, then reads only it: a rank whose
  L3 holds all 8 pages does not read 8 when another holds 3).
- MAX fields: "terminated" (this rank's reads failed short, or its timeout passed). Terminated anywhere
  means terminated everywhere: no rank waits for pages that another rank can never contribute.

Every count only grows, so a step that agrees on zeros (a rank with no news) changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from tierkv.cache.cost_model import CostModel
from tierkv.pools.kv import HostKVPool
from tierkv.radix import RadixKey, TreeNode
from tierkv.storage.base import PageStore, prefix_keys_arg

log = logging.getLogger(__name__)

# per prefetch in the progress vectors: MIN (completed pages, finished, 1 + pages found), MAX (terminated).
# "Found" travels as 1 + pages so that 0 stays the neutral "no news yet" of every field.
NUM_MIN_COUNTS = 3
NUM_MAX_COUNTS = 1
_FOUND_UNKNOWN = -1
_AGREEMENT_POLL_S = 0.01


@dataclass(eq=False)
class Prefetch:
    """Pages ``hashes`` (the key beyond ``anchor``, which starts ``anchor_len`` elements in) into ``host_slots``.

    While running it holds one host_ref on ``anchor``. ``state`` moves running -> done, or running ->
    revoked (nothing found), or running -> draining (ended while the worker may still write into the
    slots it kept; they are freed once the worker is agreed finished). ``agree_found`` (several TP
    ranks): the worker reads only the leading run of pages that every rank found, once agreed, and
    nothing when that run is under ``min_found_pages`` (the controller then revokes it). The timeout
    budget is ``timeout_base_s`` plus ``timeout_per_page_s`` per page found (agreed), HiCache's rule.
    ``costs`` (the cache's cost model) gets every call's time and cuts the read to the pages that are
    cheaper to fetch than to recompute; the rest are recomputed.
    """

    request_id: str
    anchor: TreeNode
    anchor_len: int
    key: RadixKey
    hashes: list[str]
    host_slots: torch.Tensor
    host_pages: list[int]
    timeout_base_s: float
    timeout_per_page_s: float
    started_s: float = field(default_factory=time.monotonic)
    state: str = "running"
    agree_found: bool = False
    min_found_pages: int = 0
    prefix_hashes: list[str] | None = None  # the anchor path's page hashes, for stores that want them
    page_size: int = 1
    costs: CostModel | None = None  # times every call; cuts the read to what beats recomputing
    # written by the worker thread only
    found_pages: int = 0
    completed_pages: int = 0
    failed: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    exists_done: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # agreed across ranks; scheduler thread only (``found_agreed`` is how the worker learns agreed_found)
    agreed_pages: int = 0
    agreed_finished: bool = False
    agreed_found: int = _FOUND_UNKNOWN
    agreed_terminated: bool = False
    found_agreed: threading.Event = field(default_factory=threading.Event)

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    def local_counts(self) -> tuple[list[int], list[int]]:
        """This rank's progress: MIN fields (completed pages, finished, 1 + pages found), MAX (terminated)."""
        finished = self.finished.is_set()  # read first: once set, completed_pages and failed are final
        found = 1 + self.found_pages if self.exists_done.is_set() else 0
        timed_out = time.monotonic() - self.started_s >= self.budget_s
        terminated = (finished and self.failed) or timed_out
        return [self.completed_pages, int(finished), found], [int(terminated)]

    @property
    def budget_s(self) -> float:
        """The timeout policy's budget: grows with the pages L3 holds, once agreed (base until then)."""
        return self.timeout_base_s + self.timeout_per_page_s * max(self.agreed_found, 0)

    def agree(self, min_counts: list[int], max_counts: list[int]) -> None:
        """Record counts agreed across ranks (MIN fields, MAX fields; see the module docstring)."""
        self.agreed_pages = max(self.agreed_pages, min(min_counts[0], self.num_pages))
        self.agreed_finished = self.agreed_finished or bool(min_counts[1])
        if self.agreed_found == _FOUND_UNKNOWN and min_counts[2] > 0:
            self.agreed_found = min_counts[2] - 1
            self.found_agreed.set()
        self.agreed_terminated = self.agreed_terminated or bool(max_counts[0])

    def may_stop(self, policy: str) -> bool:
        """Whether the stop policy lets the request go now (from agreed state only).

        Terminated anywhere (a rank's reads failed short, or its timeout passed) stops every policy:
        the pages every rank holds can no longer grow past what the agreed count already says.
        """
        if policy == "best_effort" or self.agreed_terminated:
            return True
        return self.agreed_finished

    def wait_worker(self, timeout_s: float) -> bool:
        """Wait until the worker is done or, with several ranks, parked until a step agrees the pages
        found (waiting longer could only stall: that agreement needs the caller's next step)."""
        if not self.agree_found:
            return self.finished.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while not self.finished.wait(_AGREEMENT_POLL_S):
            if self.exists_done.is_set() and not self.found_agreed.is_set():
                return True
            if time.monotonic() >= deadline:
                return False
        return True

    # ---- worker thread ------------------------------------------------------------------------
    def _prefix_keys(self, start: int) -> dict[str, list[str]]:
        return prefix_keys_arg(self.prefix_hashes, self.hashes, start)

    def run(self, store: PageStore, host_pool: HostKVPool, batch_pages: int) -> None:
        """Query the leading run of present pages and read it into the host slots, batch by batch."""
        try:
            if self.cancel.is_set():
                return
            try:
                started_s = time.perf_counter()
                self.found_pages = store.batch_exists(self.hashes, **self._prefix_keys(0))
                if self.costs is not None:
                    self.costs.observe_l3_exists(time.perf_counter() - started_s)
            finally:  # a failed exists finds 0 pages: the other ranks must not wait for this one
                self.exists_done.set()
            num_pages = self._pages_to_read()
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

    def _pages_to_read(self) -> int:
        """The pages found here or, with several ranks, the count every rank found (0 when cancelled)."""
        found = self.found_pages
        if self.agree_found:
            while not self.found_agreed.wait(_AGREEMENT_POLL_S):
                if self.cancel.is_set():
                    return 0
            found = min(self.agreed_found, found)
        if found < self.min_found_pages:
            return 0  # too short to be worth it: revoked
        if self.costs is None:
            return found
        # what is not read is recomputed: ranks may cut differently, the agreed MIN of pages still holds
        return self.costs.l3_pages_to_fetch(self.anchor_len, found, self.page_size)

    def _read(self, store: PageStore, host_pool: HostKVPool, start: int, end: int) -> bool:
        pages = self.host_pages[start:end]
        direct = [host_pool.page_bytes(p) for p in pages]
        targets = [d if d is not None else torch.empty(host_pool.page_nbytes, dtype=torch.uint8) for d in direct]
        started_s = time.perf_counter()
        ok = store.batch_get(self.hashes[start:end], targets, **self._prefix_keys(start))
        if self.costs is not None:
            self.costs.observe_l3_get(time.perf_counter() - started_s, end - start)
        for i, (page, view, target) in enumerate(zip(pages, direct, targets)):
            if not ok[i]:
                return False  # a missing or corrupt page ends the usable prefix
            if view is None:
                host_pool.write_page(page, target)
            self.completed_pages = start + i + 1
        return True
