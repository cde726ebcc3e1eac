"""In-process page store: a dict of blobs (payload then header). The reference backend for tests.

Each page is one numpy buffer of exactly the stored size (no tensor or per-page object beyond it), so
memory use stays close to the stored bytes. With ``max_bytes`` the least recently used pages (read
or written) of this store are dropped when a write takes it over the bound.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tierkv.storage.base import LruIndex, PageStore, check_key, check_max_bytes
from tierkv.storage.page_format import copy_with_checksum


class MemoryStore(PageStore):
    """Pages live in this process only; ``blobs`` is shared between stores given the same dict."""

    name = "memory"

    def __init__(self, namespace: str, page_nbytes: int, blobs: dict[str, np.ndarray] | None = None,
                 max_bytes: int | None = None, page_key: bytes | str | None = None) -> None:
        super().__init__(namespace, page_nbytes, page_key)
        # Keys are prefixed by the namespace digest so stores sharing ``blobs`` stay apart.
        self._prefix = self.namespace_tag + ":"
        self.blobs = {} if blobs is None else blobs
        self._lock = threading.Lock()
        self.max_bytes = check_max_bytes(max_bytes, self.format.blob_nbytes)
        # Only this store's own pages count towards its bound, even when ``blobs`` is shared.
        self._index = LruIndex(self.max_bytes) if self.max_bytes is not None else None

    @property
    def size_bytes(self) -> int:
        """Bytes of this store's pages (payload and header)."""
        with self._lock:
            if self._index is not None:
                return self._index.size_bytes
            return sum(len(b) for s, b in self.blobs.items() if s.startswith(self._prefix))

    def _slot(self, key: str) -> str:
        return self._prefix + check_key(key)

    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        slots = [self._slot(k) for k in keys]
        with self._lock:
            for i, slot in enumerate(slots):
                if slot not in self.blobs:
                    return i
        return len(slots)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, targets)
        found = []
        with self._timed("get"):
            for key, view in zip(keys, views):
                slot = self._slot(key)
                with self._lock:
                    blob = self.blobs.get(slot)
                    if blob is not None and self._index is not None:
                        self._index.touch(slot)
                if blob is None:
                    found.append(False)
                    continue
                header, payload = self.format.split(memoryview(blob))
                state = None
                if len(payload) == self.page_nbytes:
                    state = copy_with_checksum(view, payload, self.format.payload_hasher(key))
                ok = self._verified(key, header, payload, state)
                if ok:
                    self._count(get_pages=1, get_bytes=self.page_nbytes)
                found.append(ok)
        return found

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, values)
        with self._timed("set"):
            for key, view in zip(keys, views):
                blob = np.empty(self.format.blob_nbytes, dtype=np.uint8)  # no zero-fill before the copy
                state = copy_with_checksum(memoryview(blob)[:self.page_nbytes], view,
                                           self.format.payload_hasher(key))
                header = self.format.header(key, view, state)
                blob[self.page_nbytes:] = np.frombuffer(header, np.uint8)
                self._put(self._slot(key), blob)
                self._count(set_pages=1, set_bytes=self.page_nbytes)
        return [True] * len(keys)

    def _put(self, slot: str, blob: np.ndarray) -> None:
        with self._lock:
            self.blobs[slot] = blob
            victims = [] if self._index is None else self._index.add(slot, len(blob))
            for victim in victims:
                self.blobs.pop(victim, None)
        if victims:
            self._count(evicted_pages=len(victims))

    def _drop(self, key: str) -> None:
        slot = self._slot(key)
        with self._lock:
            self.blobs.pop(slot, None)
            if self._index is not None:
                self._index.remove(slot)

    def clear(self) -> None:
        with self._lock:
            for slot in [s for s in self.blobs if s.startswith(self._prefix)]:
                del self.blobs[slot]
            if self._index is not None:
                self._index.clear()
