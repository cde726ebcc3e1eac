"""A prefetch from L3 into L2 in flight: one object owning its host slots, hashes and completion state.

The worker thread fills host pages in order and only ever raises ``completed_pages``, then sets
``finished``. The scheduler thread sees that progress only through agreed counts (see
:meth:`Prefetch.local_counts` / :meth:`Prefetch.agree`), so every TP rank decides alike. Counts are
agreed by element-wise MIN: a rank inserts only the pages every rank has, a prefetch is finished when
it is finished everywhere, and the timeout fires once every rank's clock has passed it. Every count
only grows, so a step that agrees on zeros (a rank with no news) changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from tierkv.pools.kv import HostKVPool
from tierkv.radix import RadixKey, TreeNode
from tierkv.storage.base import PageStore

log = logging.getLogger(__name__)

NUM_COUNTS = 3  # per prefetch in the progress vector: completed pages, finished, timed out


@dataclass(eq=False)
class Prefetch:
    """Pages ``hashes`` (the key beyond ``anchor``, which starts ``anchor_len`` elements in) into ``host_slots``.

    While running it holds one host_ref on ``anchor``. ``state`` moves running -> done, or running ->
    revoked (nothing found), or running -> draining (ended while the worker may still write into the
    slots it kept; they are freed once the worker is agreed finished).
    """

    request_id: str
    anchor: TreeNode
    anchor_len: int
    key: RadixKey
    hashes: list[str]
    host_slots: torch.Tensor
    host_pages: list[int]
    timeout_s: float
    started_s: float = field(default_factory=time.monotonic)
    state: str = "running"
    # written by the worker thread only
    found_pages: int = 0
    completed_pages: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # agreed across ranks; scheduler thread only
    agreed_pages: int = 0
    agreed_finished: bool = False
    agreed_timed_out: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    def local_counts(self) -> list[int]:
        """This rank's progress: completed pages, finished, finished-or-timed-out."""
        finished = self.finished.is_set()  # read first: once set, completed_pages is final
        timed_out = time.monotonic() - self.started_s >= self.timeout_s
        return [self.completed_pages, int(finished), int(finished or timed_out)]

    def agree(self, counts: list[int]) -> None:
        """Record counts agreed (element-wise minimum) across ranks."""
        self.agreed_pages = max(self.agreed_pages, min(counts[0], self.num_pages))
        self.agreed_finished = self.agreed_finished or bool(counts[1])
        self.agreed_timed_out = self.agreed_timed_out or bool(counts[2])

    def may_stop(self, policy: str) -> bool:
        """Whether the stop policy lets the request go now (from agreed state only)."""
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return self.agreed_finished
        return self.agreed_finished or self.agreed_timed_out

    # ---- worker thread ------------------------------------------------------------------------
    def run(self, store: PageStore, host_pool: HostKVPool, batch_pages: int) -> None:
        """Query the leading run of present pages and read it into the host slots, batch by batch."""
        try:
            if self.cancel.is_set():
                return
            self.found_pages = store.batch_exists(self.hashes)
            for start in range(0, self.found_pages, batch_pages):
                if self.cancel.is_set():
                    return
                if not self._read(store, host_pool, start, min(self.found_pages, start + batch_pages)):
                    return
        except Exception as exc:  # a failing backend means fewer pages, never a crash
            log.warning("prefetch %s: storage failed after %d pages: %s: %s", self.request_id,
                        self.completed_pages, type(exc).__name__, exc)
        finally:
            self.finished.set()

    def _read(self, store: PageStore, host_pool: HostKVPool, start: int, end: int) -> bool:
        pages = self.host_pages[start:end]
        direct = [host_pool.page_bytes(p) for p in pages]
        targets = [d if d is not None else torch.empty(host_pool.page_nbytes, dtype=torch.uint8) for d in direct]
        ok = store.batch_get(self.hashes[start:end], targets)
        for i, (page, view, target) in enumerate(zip(pages, direct, targets)):
            if not ok[i]:
                return False  # a missing or corrupt page ends the usable prefix
            if view is None:
                host_pool.write_page(page, target)
            self.completed_pages = start + i + 1
        return True
