"""The L3-facing methods of :class:`tierkv.cache.hicache.HiRadixCache`, which delegate to its StorageController.

Kept beside hicache.py so that module holds the L1/L2 policy only; the L3 policy itself lives in
:mod:`tierkv.cache.l3.controller`.
"""

from __future__ import annotations

from tierkv.hashing import HashNamespace
from tierkv.radix import RadixKey, TreeNode
from tierkv.storage.base import PageStore
from tierkv.storage.config import StorageConfig
from tierkv.cache.l3.controller import StorageController
from tierkv.copy.transfer import TransferController


class StorageTierMethods:
    """Mixed into HiRadixCache: the cache's L3 tier, ``storage`` (None until attached)."""

    storage: StorageController | None
    transfer: TransferController | None

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

    def clear_storage_backend(self) -> bool:
        """Empty L3 (this namespace's pages), keeping L1 and L2; False when no L3 is attached or its
        backend cannot clear. Lock contract: takes no lock."""
        return self.storage is not None and self.storage.clear_store()
