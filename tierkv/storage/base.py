"""The L3 interface: a page store keyed by chained page hashes. It knows nothing of the tree.

Pages move as uint8 tensors of exactly ``page_nbytes`` bytes (a host-pool page view when the layout
keeps a page contiguous, so reads and writes need no staging copy). Every stored page carries a
header (see :mod:`tierkv.storage.page_format`); a page that fails verification is reported as a miss.

Thread contract: methods are called from the storage worker threads, one batch at a time per thread;
implementations must be safe for one reader thread and one writer thread at once.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from tierkv.storage.page_format import PageFormat

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    """Counters every backend keeps; throughput is bytes over the seconds spent in batch calls."""

    get_pages: int = 0
    get_bytes: int = 0
    get_seconds: float = 0.0
    set_pages: int = 0
    set_bytes: int = 0
    set_seconds: float = 0.0
    exists_calls: int = 0
    corrupt_pages: int = 0
    errors: int = 0
    extra: dict = field(default_factory=dict)


class PageStore(ABC):
    """Abstract L3 backend. ``namespace`` names model, tenant, KV layout and TP shard (see hashing)."""

    name = "abstract"

    def __init__(self, namespace: str, page_nbytes: int) -> None:
        self.format = PageFormat(namespace, page_nbytes)
        self.page_nbytes = page_nbytes
        self.stats = StoreStats()

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """Length of the leading run of ``keys`` present in the store."""

    @abstractmethod
    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        """Read each page into its uint8 target; False for a missing or corrupt page (target undefined)."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        """Store each uint8 page under its key; False where the write failed."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every page of this store's namespace/prefix."""

    def close(self) -> None:
        """Release connections and files."""
