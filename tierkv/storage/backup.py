"""A backup from L2 to L3 in flight: the pages of one node's path, protected in L2 until acknowledged."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from tierkv.pools.kv import HostKVPool
from tierkv.radix import TreeNode
from tierkv.storage.base import PageStore

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Backup:
    """Writes ``hashes`` from ``host_pages``; holds one host_ref on ``node`` until the controller retires it.

    Pages already present at the head (batch_exists) are skipped. Only ``done`` and the page counts are
    written by the worker thread.
    """

    node: TreeNode
    hashes: list[str]
    host_pages: list[int]
    page_size: int
    done: threading.Event = field(default_factory=threading.Event)
    skipped_pages: int = 0
    written_pages: int = 0
    failed_pages: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.page_size

    def run(self, store: PageStore, host_pool: HostKVPool, batch_pages: int) -> None:
        """Skip the leading run already stored and write the rest (host-pool page views where possible)."""
        try:
            self.skipped_pages = store.batch_exists(self.hashes)
            for start in range(self.skipped_pages, len(self.hashes), batch_pages):
                end = min(len(self.hashes), start + batch_pages)
                values = [host_pool.read_page(p) for p in self.host_pages[start:end]]
                ok = store.batch_set(self.hashes[start:end], values)
                self.written_pages += sum(ok)
                self.failed_pages += len(ok) - sum(ok)
        except Exception as exc:  # L3 is a cache: a failed backup only costs a future miss
            log.warning("backup of node %d failed: %s: %s", self.node.id, type(exc).__name__, exc)
            self.failed_pages = len(self.hashes) - self.skipped_pages - self.written_pages
        finally:
            self.done.set()
