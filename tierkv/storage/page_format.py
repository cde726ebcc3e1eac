"""The header every stored page carries, verified on read so a bad page is a miss, never wrong KV.

A stored page is the payload followed by the header (a trailer), so the payload keeps the alignment
of wherever it lands (file offset 0, the start of a remote object); a payload at offset 48 made the
kernel's page-cache copies ~20% slower here.

Header layout (little endian, 48 bytes): magic b"TKV1", format version u16, flags u16, namespace digest
(16 bytes), payload length u64, xxh3-64 checksum of the payload u64, page key digest (8 bytes).

With a page key (a shared secret), flag ``FLAG_MAC`` is set and the last 16 bytes hold instead a keyed
MAC: HMAC-SHA256, truncated to 128 bits, over the other header fields, the page key string and the
payload. Every header field is computable from public facts, so without a MAC anyone who can write to
a shared store could plant KV for a guessable prompt; with one, a page not written by a holder of the
secret is a miss. A store with a key refuses pages without a MAC, and a store without one refuses
pages with a MAC (it cannot check them).

Verification state: the chunked copy/read/write loops feed a *payload hasher* from
:meth:`PageFormat.payload_hasher` (xxh3-64, or the MAC already fed with the header fields) while the
bytes are in cache, and hand it to :meth:`PageFormat.header` / :meth:`PageFormat.verify`.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from tierkv.storage import native

MAGIC = b"TKV1"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQQ8s")
HEADER_SIZE = _HEADER.size
CHECKSUM_OFFSET = 32  # of the xxh3-64 field in an unkeyed header (see header_templates)
_MAC_HEADER = struct.Struct("<4sHH16sQ16s")  # same size: the checksum and key digest become the MAC
_MAC_PREFIX = struct.Struct("<4sHH16sQ")
FLAG_MAC = 1
MAC_NBYTES = 16
MIN_PAGE_KEY_NBYTES = 16
# Checksums run over chunks that still sit in the core's cache after the copy or read that brought
# them, so verification costs almost no extra memory traffic (a cold 8 MiB pass halves throughput).
CHUNK_NBYTES = 256 << 10


class PageFormatError(ValueError):
    """A stored page failed verification (wrong version, namespace, length, checksum or key)."""


class Digest:
    """A payload checksum computed elsewhere (the native page I/O), standing in for a fed hasher."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def intdigest(self) -> int:
        return self.value


def namespace_digest(namespace: str) -> bytes:
    return hashlib.sha256(namespace.encode()).digest()[:16]


def _key_digest(key: str) -> bytes:
    return xxhash.xxh64_digest(key.encode())


def checksum(payload: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def copy_with_checksum(dst: memoryview, src: memoryview, state: Any = None) -> Any:
    """Copy ``src`` into ``dst`` (same length) chunk by chunk, feeding each chunk to ``state`` (a payload
    hasher; a fresh xxh3-64 if None) while it is in cache; return the hasher."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    state = xxhash.xxh3_64() if state is None else state
    dst_array, src_array = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    for start in range(0, len(src), CHUNK_NBYTES):
        end = start + CHUNK_NBYTES
        dst_array[start:end] = src_array[start:end]
        state.update(dst[start:end])
    return state


def check_page_key(page_key: object) -> bytes | None:
    """``page_key`` as bytes (None stays None); ValueError, never showing the key, if it is too weak."""
    if page_key is None:
        return None
    if isinstance(page_key, str):
        page_key = page_key.encode()
    if not isinstance(page_key, (bytes, bytearray)) or len(page_key) < MIN_PAGE_KEY_NBYTES:
        raise ValueError(f"page_key must be a string or bytes of at least {MIN_PAGE_KEY_NBYTES} bytes "
                         f"(got a {type(page_key).__name__}, value not shown)")
    return bytes(page_key)


@dataclass(frozen=True)
class PageFormat:
    """Encodes and checks headers for one namespace and one page size in bytes (keyed: with a MAC)."""

    namespace: str
    payload_nbytes: int
    page_key: bytes | None = field(default=None, repr=False, compare=False)  # a secret: never shown

    @property
    def blob_nbytes(self) -> int:
        return HEADER_SIZE + self.payload_nbytes

    @staticmethod
    def split(blob: memoryview) -> tuple[memoryview, memoryview]:
        """(header, payload) of a stored blob; a blob of the wrong size fails :meth:`verify`."""
        if len(blob) < HEADER_SIZE:
            return blob, blob[:0]
        return blob[len(blob) - HEADER_SIZE:], blob[:len(blob) - HEADER_SIZE]

    def __post_init__(self) -> None:
        object.__setattr__(self, "page_key", check_page_key(self.page_key))
        object.__setattr__(self, "_namespace_digest", namespace_digest(self.namespace))

    @property
    def keyed(self) -> bool:
        return self.page_key is not None

    def payload_hasher(self, key: str) -> Any:
        """A fresh hasher for the payload of page ``key``: xxh3-64, or the MAC fed with the header fields."""
        if self.page_key is None:
            return xxhash.xxh3_64()
        prefix = _MAC_PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_MAC, self._namespace_digest, self.payload_nbytes)
        return hmac.new(self.page_key, prefix + key.encode(), hashlib.sha256)

    def _fed(self, key: str, payload: memoryview, state: Any) -> Any:
        if state is None:
            state = self.payload_hasher(key)
            state.update(payload)
        return state

    def header(self, key: str, payload: memoryview, state: Any = None) -> bytes:
        """The header of ``payload`` stored under ``key`` (pass its payload hasher if already fed)."""
        state = self._fed(key, payload, state)
        if self.page_key is not None:
            if len(payload) != self.payload_nbytes:  # the MAC was fed this length
                raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_nbytes}")
            return _MAC_HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_MAC, self._namespace_digest, len(payload),
                                    state.digest()[:MAC_NBYTES])
        return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, self._namespace_digest, len(payload),
                            state.intdigest(), _key_digest(key))

    def header_templates(self, keys: list[str]) -> bytearray:
        """The unkeyed headers of pages ``keys`` back to back, each with its checksum field (at
        ``CHECKSUM_OFFSET``) zero: the native I/O fills it in a write and checks a read against it."""
        return bytearray(self._header_rows(keys))

    def filled_headers(self, keys: list[str], digests: list[int]) -> np.ndarray:
        """The unkeyed headers of pages ``keys`` with payload checksums ``digests``: (pages, 48) uint8."""
        headers = self._header_rows(keys)
        headers[:, CHECKSUM_OFFSET:CHECKSUM_OFFSET + 8] = (
            np.array(digests, dtype="<u8").view(np.uint8).reshape(len(keys), 8))
        return headers

    def _header_rows(self, keys: list[str]) -> np.ndarray:
        """Unkeyed headers as (pages, 48) uint8 rows, checksums zero: one row broadcast, then the key
        digests as one column (a header built and joined per page cost twice as much)."""
        if self.page_key is not None:
            raise ValueError("a keyed store's header holds a MAC, not a checksum: no template")
        row = np.frombuffer(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, self._namespace_digest, self.payload_nbytes, 0,
                                         bytes(8)), np.uint8)
        headers = np.empty((len(keys), HEADER_SIZE), np.uint8)
        headers[:] = row
        # the key digest field holds xxh64's canonical (big-endian) digest of the key, as _key_digest
        if native.pageio is not None:  # one C loop (a Python call a key: ~0.2 CPU-s of a replay's backups)
            key_digests = np.frombuffer(native.pageio.key_digests(keys), ">u8")
        else:
            key_digests = np.fromiter(map(xxhash.xxh64_intdigest, map(str.encode, keys)), ">u8", len(keys))
        headers[:, CHECKSUM_OFFSET + 8:] = key_digests.view(np.uint8).reshape(len(keys), 8)
        return headers

    def check_headers(self, keys: list[str], headers: np.ndarray, payloads: list[memoryview],
                      digests: list[int]) -> list[tuple[int, PageFormatError]]:
        """(index, error) of each unkeyed page whose stored header (a row of ``headers``) differs from
        the one its payload checksum (``digests``) makes: one vectorised compare, then each page that
        differs explained by :meth:`verify`."""
        bad = np.flatnonzero((self.filled_headers(keys, digests) != headers).any(axis=1))
        failures = []
        for i in bad.tolist():
            try:
                self.verify(keys[i], headers[i].tobytes(), payloads[i], Digest(digests[i]))
                failures.append((i, PageFormatError(f"page {keys[i]}: header differs from its expected bytes")))
            except PageFormatError as err:
                failures.append((i, err))
        return failures

    def verify(self, key: str, header: bytes | memoryview, payload: memoryview, state: Any = None) -> None:
        """Raise :class:`PageFormatError` naming what does not match (payload hashed unless ``state``)."""
        if len(header) != HEADER_SIZE:
            raise PageFormatError(f"page {key}: header of {len(header)} bytes, expected {HEADER_SIZE}")
        magic, version, flags, ns, length, stored_checksum, key_digest = _HEADER.unpack(header)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise PageFormatError(f"page {key}: format {magic!r} v{version}, expected {MAGIC!r} "
                                  f"v{FORMAT_VERSION}")
        if ns != self._namespace_digest:
            raise PageFormatError(f"page {key}: written under another namespace")
        if bool(flags & FLAG_MAC) != self.keyed:
            raise PageFormatError(f"page {key}: " + ("carries no MAC, and this store has a page_key"
                                                     if self.keyed else "carries a MAC, and this store has no "
                                                     "page_key to check it"))
        if not self.keyed and key_digest != _key_digest(key):
            raise PageFormatError(f"page {key}: header names another key")
        if length != self.payload_nbytes or len(payload) != length:
            raise PageFormatError(f"page {key}: payload {len(payload)} bytes, header {length}, "
                                  f"expected {self.payload_nbytes}")
        state = self._fed(key, payload, state)
        if self.keyed:
            if not hmac.compare_digest(state.digest()[:MAC_NBYTES], _MAC_HEADER.unpack(header)[5]):
                raise PageFormatError(f"page {key}: MAC mismatch (not written with this page_key)")
        elif state.intdigest() != stored_checksum:
            raise PageFormatError(f"page {key}: checksum mismatch")
