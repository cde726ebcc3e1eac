"""In-process page store: a dict of blobs (payload then header). The reference backend for tests.

Each page is one bytearray of exactly the stored size under a 48-byte key (no tensor, no index entry
beyond the dict's), so memory use stays close to the stored bytes (RSS 1.02x of them at 4 KiB pages,
1.37x at 256 B). With ``max_bytes`` the least recently used pages (read or written) of this store are
dropped when a write takes it over the bound.
"""

from __future__ import annotations

import threading

import torch

from tierkv.storage.base import PageStore, check_key, check_max_bytes
from tierkv.storage.page_format import copy_with_checksum


class MemoryStore(PageStore):
    """Pages live in this process only; ``blobs`` is shared between stores given the same dict.

    The dict's own insertion order is the recency order (a read moves its page to the end), so a
    bound costs no per-page object beyond the blob and its key.
    """

    name = "memory"

    def __init__(self, namespace: str, page_nbytes: int, blobs: dict[bytes, bytearray] | None = None,
                 max_bytes: int | None = None, page_key: bytes | str | None = None) -> None:
        super().__init__(namespace, page_nbytes, page_key)
        # Keys are prefixed by the namespace digest so stores sharing ``blobs`` stay apart; raw bytes,
        # not hex text, since for small pages the key is a good part of what a page costs.
        self._prefix = bytes.fromhex(self.namespace_tag)
        self.blobs = {} if blobs is None else blobs
        self._lock = threading.Lock()
        self.max_bytes = check_max_bytes(max_bytes, self.format.blob_nbytes)
        self._size_bytes = 0  # of this store's own pages, even when ``blobs`` is shared

    @property
    def size_bytes(self) -> int:
        """Bytes of this store's pages (payload and header)."""
        with self._lock:
            return self._size_bytes

    def _slot(self, key: str) -> bytes:
        return self._prefix + bytes.fromhex(check_key(key))

    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        slots = [self._slot(k) for k in keys]
        with self._lock:
            for i, slot in enumerate(slots):
                if slot not in self.blobs:
                    return i
                if self.max_bytes is not None:  # a page asked for is in use, as in the file store
                    self.blobs[slot] = self.blobs.pop(slot)
        return len(slots)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        return self._get_views(keys, self._check_batch(keys, targets))

    def _get_views(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        found = []
        with self._timed("get"):
            for key, view in zip(keys, views):
                slot = self._slot(key)
                with self._lock:
                    blob = self.blobs.get(slot)
                    if blob is not None and self.max_bytes is not None:
                        self.blobs[slot] = self.blobs.pop(slot)  # now the most recently used
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
        return self._set_views(keys, self._check_batch(keys, values))

    def _set_views(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        with self._timed("set"):
            for key, view in zip(keys, views):
                # A bytearray is the smallest mutable buffer object; large ones come zeroed from mmap,
                # so the zero-fill costs no pass over memory.
                blob = bytearray(self.format.blob_nbytes)
                state = copy_with_checksum(memoryview(blob)[:self.page_nbytes], view,
                                           self.format.payload_hasher(key))
                blob[self.page_nbytes:] = self.format.header(key, view, state)
                self._put(self._slot(key), blob)
                self._count(set_pages=1, set_bytes=self.page_nbytes)
        return [True] * len(keys)

    def _put(self, slot: bytes, blob: bytearray) -> None:
        evicted = 0
        with self._lock:
            old = self.blobs.pop(slot, None)
            self.blobs[slot] = blob
            self._size_bytes += len(blob) - (0 if old is None else len(old))
            while self.max_bytes is not None and self._size_bytes > self.max_bytes:
                # The oldest page of this store: the first one in the dict's order with our prefix.
                victim = next(s for s in self.blobs if s.startswith(self._prefix))
                self._size_bytes -= len(self.blobs.pop(victim))
                evicted += 1
        if evicted:
            self._count(evicted_pages=evicted)

    def _drop(self, key: str) -> None:
        slot = self._slot(key)
        with self._lock:
            blob = self.blobs.pop(slot, None)
            self._size_bytes -= 0 if blob is None else len(blob)

    def clear(self) -> None:
        with self._lock:
            for slot in [s for s in self.blobs if s.startswith(self._prefix)]:
                del self.blobs[slot]
            self._size_bytes = 0
