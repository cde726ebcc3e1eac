"""The header every stored page carries, verified on read so a bad page is a miss, never wrong KV.

A stored page is the payload followed by the header (a trailer), so the payload keeps the alignment
of wherever it lands (file offset 0, the start of a remote object); a payload at offset 48 made the
kernel's page-cache copies ~20% slower here.

Header layout (little endian, 48 bytes): magic b"TKV1", format version u16, flags u16, namespace digest
(16 bytes), payload length u64, xxh3-64 checksum of the payload u64, page key digest (8 bytes).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"TKV1"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH16sQQ8s")
HEADER_SIZE = _HEADER.size
# Checksums run over chunks that still sit in the core's cache after the copy or read that brought
# them, so verification costs almost no extra memory traffic (a cold 8 MiB pass halves throughput).
CHUNK_NBYTES = 256 << 10


class PageFormatError(ValueError):
    """A stored page failed verification (wrong version, namespace, length, checksum or key)."""


def namespace_digest(namespace: str) -> bytes:
    return hashlib.sha256(namespace.encode()).digest()[:16]


def _key_digest(key: str) -> bytes:
    return xxhash.xxh64_digest(key.encode())


def checksum(payload: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def copy_with_checksum(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` (same length) chunk by chunk; return the checksum of the bytes."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    state = xxhash.xxh3_64()
    dst_array, src_array = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    for start in range(0, len(src), CHUNK_NBYTES):
        end = start + CHUNK_NBYTES
        dst_array[start:end] = src_array[start:end]
        state.update(dst[start:end])
    return state.intdigest()


@dataclass(frozen=True)
class PageFormat:
    """Encodes and checks headers for one namespace and one page size in bytes."""

    namespace: str
    payload_nbytes: int

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
        object.__setattr__(self, "_namespace_digest", namespace_digest(self.namespace))

    def header(self, key: str, payload: memoryview, payload_checksum: int | None = None) -> bytes:
        """The header of ``payload`` stored under ``key`` (pass the checksum if already computed)."""
        if payload_checksum is None:
            payload_checksum = checksum(payload)
        return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, self._namespace_digest, len(payload),
                            payload_checksum, _key_digest(key))

    def verify(self, key: str, header: bytes | memoryview, payload: memoryview,
               payload_checksum: int | None = None) -> None:
        """Raise :class:`PageFormatError` naming what does not match (checksum computed unless given)."""
        if len(header) != HEADER_SIZE:
            raise PageFormatError(f"page {key}: header of {len(header)} bytes, expected {HEADER_SIZE}")
        magic, version, _, ns, length, stored_checksum, key_digest = _HEADER.unpack(header)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise PageFormatError(f"page {key}: format {magic!r} v{version}, expected {MAGIC!r} "
                                  f"v{FORMAT_VERSION}")
        if ns != self._namespace_digest:
            raise PageFormatError(f"page {key}: written under another namespace")
        if key_digest != _key_digest(key):
            raise PageFormatError(f"page {key}: header names another key")
        if length != self.payload_nbytes or len(payload) != length:
            raise PageFormatError(f"page {key}: payload {len(payload)} bytes, header {length}, "
                                  f"expected {self.payload_nbytes}")
        if payload_checksum is None:
            payload_checksum = checksum(payload)
        if payload_checksum != stored_checksum:
            raise PageFormatError(f"page {key}: checksum mismatch")
