"""The header every stored page carries, verified on read so a bad page is a miss, never wrong KV.

Layout (little endian, 48 bytes): magic b"TKV1", format version u16, flags u16, namespace digest
(16 bytes), payload length u64, xxh3-64 checksum of the payload u64, page key digest (8 bytes).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"TKV1"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQQ8s")
HEADER_SIZE = _HEADER.size


class PageFormatError(ValueError):
    """A stored page failed verification (wrong version, namespace, length, checksum or key)."""


def namespace_digest(namespace: str) -> bytes:
    return hashlib.sha256(namespace.encode()).digest()[:16]


def _key_digest(key: str) -> bytes:
    return xxhash.xxh64_digest(key.encode())


@dataclass(frozen=True)
class PageFormat:
    """Encodes and checks headers for one namespace and one page size in bytes."""

    namespace: str
    payload_nbytes: int

    @property
    def blob_nbytes(self) -> int:
        return HEADER_SIZE + self.payload_nbytes

    def header(self, key: str, payload: memoryview) -> bytes:
        return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, namespace_digest(self.namespace), len(payload),
                            xxhash.xxh3_64_intdigest(payload), _key_digest(key))

    def verify(self, key: str, header: bytes | memoryview, payload: memoryview) -> None:
        """Raise :class:`PageFormatError` naming what does not match."""
        if len(header) != HEADER_SIZE:
            raise PageFormatError(f"page {key}: header of {len(header)} bytes, expected {HEADER_SIZE}")
        magic, version, _, ns, length, checksum, key_digest = _HEADER.unpack(header)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise PageFormatError(f"page {key}: format {magic!r} v{version}, expected {MAGIC!r} "
                                  f"v{FORMAT_VERSION}")
        if ns != namespace_digest(self.namespace):
            raise PageFormatError(f"page {key}: written under another namespace")
        if key_digest != _key_digest(key):
            raise PageFormatError(f"page {key}: header names another key")
        if length != self.payload_nbytes or len(payload) != length:
            raise PageFormatError(f"page {key}: payload {len(payload)} bytes, header {length}, "
                                  f"expected {self.payload_nbytes}")
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise PageFormatError(f"page {key}: checksum mismatch")
