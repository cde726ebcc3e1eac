"""Page store on Mooncake Store (``mooncake-transfer-engine``, TCP or RDMA) via its Python client.

Each page is one object: the payload then the 48-byte header, written from and read into two buffers
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``), so the payload moves straight
between the host pool's memory and the store. A batch goes in ranges of ``RANGE_NBYTES`` (each call
costs a round trip to the master) that the calling thread and a helper take in turn, each range hashed
and put, or fetched and verified, by the thread that took it (see
:func:`tierkv.storage.overlap.run_ranges`): the transfer engine copies on a thread of its own, so with
two ranges in flight its copies never wait for a hash. With the native module
(:mod:`tierkv.storage.native`) a range's checksums are one GIL-free xxh3 call (and one vectorised
header compare), not Python work per page; the hash stays a pass over memory the transfer does not
make (the transfer engine's copy cannot carry it), hidden only by a spare core; unless the caller hands
in each page's digest (a backup of host pages the hashed L1 -> L2 copy wrote: see
:mod:`tierkv.pools.page_digests`), and then nothing is hashed and a batch is put in one call. Objects are
put-if-absent: a page's key names its whole prefix, so its bytes never change, and a repeated put keeps
the first copy. A page that fails verification is removed so a later backup can write it again.

A get first asks the master where each page's replica lies (the query a get makes anyway):
a replica in this client's own mounted segment is memory this process maps, so the native module copies
it into the page and hashes each chunk as it lands (:func:`tierkv.storage.native` ``copy_blobs_xxh3``),
one pass where the transfer engine's copy and the checksum make two; the other pages go through the
engine as above.

RDMA needs the host pool registered (:meth:`register_host_buffer`); TCP works without. The client is
set up on first use; a failed setup or an unreachable master counts an error, answers a miss and backs
off like the redis store.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierkv.storage import native
from tierkv.storage.base import Backoff, PageStore, check_digests, check_key
from tierkv.storage.overlap import (
    PageCheck,
    checked_group,
    copied_group,
    run_ranges,
    verify_group,
)
from tierkv.storage.page_format import (
    HEADER_SIZE,
    PageFormatError,
)

_NOT_FOUND = -704  # OBJECT_NOT_FOUND in Mooncake's error codes
_BUFFER_TOO_SMALL = -600  # the stored object is larger than a page blob: not one of our pages
# Ranges of this many bytes (at most _MAX_CALL_PAGES pages), taken in turn by IO_THREADS threads (the
# caller and one helper). Gets side by side with one call of the whole batch (raw), idle 2-core machine:
# 128 KiB pages 0.76 of raw in 2 MiB ranges, 1.14-1.22 in 8-16 MiB, 1.03 in 32 MiB; 8 MiB pages 0.90
# in 8 or 16 MiB ranges. Puts: 0.85-0.87 of raw in 16 MiB ranges where the earlier ramp of calls (a
# helper hashing the next range) or one call after an in-place hash made 0.68.
RANGE_NBYTES = 16 << 20
IO_THREADS = 2
_MAX_CALL_PAGES = 1024
_TRANSPORT_ERROR = -1
_CONNECT_TIMEOUT_S = 2.0


class MooncakeStore(PageStore):
    """A namespace of pages in a Mooncake Store cluster reached through ``master`` (``host:port``)."""

    name = "mooncake"
    # Pages whose replica lies in this client's own mounted segment are copied out of it (and hashed in the
    # same pass) instead of through the transfer engine; False: every page through the engine.
    read_in_place = True

    def __init__(self, namespace: str, page_nbytes: int, master: str,
                 metadata_server: str = "P2PHANDSHAKE", local_hostname: str = "127.0.0.1",
                 protocol: str = "tcp", device_name: str = "", global_segment_size: int = 1 << 30,
                 local_buffer_size: int = 64 << 20, key_prefix: str = "tierkv:", replica_num: int = 1,
                 retry_backoff_s: float = 0.5, page_key: bytes | str | None = None) -> None:
        super().__init__(namespace, page_nbytes, page_key)
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol {protocol!r} is not one of ('tcp', 'rdma')")
        for field, value in (("global_segment_size", global_segment_size),
                             ("local_buffer_size", local_buffer_size), ("replica_num", replica_num)):
            if value < 1:
                raise ValueError(f"mooncake {field} must be >= 1, got {value!r}")
        self.master = master
        self.key_prefix = f"{key_prefix}{self.namespace_tag}:"
        self._setup_args = (local_hostname, metadata_server, global_segment_size, local_buffer_size,
                            protocol, device_name, master)
        self.replica_num = replica_num
        self.backoff = Backoff(retry_backoff_s)
        self.client = None
        self._endpoint = ""  # this client's transport endpoint: replicas there lie in this process's memory
        self._setup_lock = threading.Lock()
        self._registered: list[torch.Tensor] = []
        # Header arenas: one for writes, and one per get thread (one reader and one writer thread may run).
        self._get_headers = torch.zeros(IO_THREADS * _MAX_CALL_PAGES, HEADER_SIZE, dtype=torch.uint8)
        self._set_headers = torch.zeros(IO_THREADS * _MAX_CALL_PAGES, HEADER_SIZE, dtype=torch.uint8)
        self._get_lock, self._set_lock = threading.Lock(), threading.Lock()
        # Native checksums (one GIL-free call and one vectorised header compare per range) for xxh3
        # pages; a MAC is computed page by page in Python.
        self._native = native.pageio if self.format.page_key is None else None
        # xxh3 headers can take the digests the L1 -> L2 copy made; a MAC is computed here whatever is given
        self.accepts_digests = self._native is not None

    def object_key(self, key: str) -> str:
        return self.key_prefix + check_key(key)

    def _connect(self):
        """The set-up client, or None (counted) while backing off or if the master cannot be reached."""
        if not self.backoff.ready():
            self._count(errors=1)
            return None
        if self.client is not None:
            return self.client
        with self._setup_lock:
            if self.client is None:
                self.client = self._setup()
        return self.client

    def _master_reachable(self) -> None:
        """Raise OSError fast if the master does not accept TCP (its client retries for ~90 s)."""
        host, _, port = self.master.rpartition(":")
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass

    def _setup(self):
        client = None
        try:
            self._master_reachable()
            # Without it the TCP transport binds to the machine's public address.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self._setup_args[0].split(":")[0])
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
            client = MooncakeDistributedStore()
            rc = client.setup(*self._setup_args)
            if rc != 0:
                raise ConnectionError(f"setup returned {rc}")
            for tensor in (self._get_headers, self._set_headers, *self._registered):
                self._register(client, tensor)
        except (ImportError, OSError, RuntimeError, ValueError) as err:
            self._error(f"setup against master {self.master}", err)
            self.backoff.failed()
            if client is not None:
                client.close()
            return None
        self._endpoint = client.get_hostname()
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = self.replica_num
        self.backoff.succeeded()
        return client

    @staticmethod
    def _register(client, tensor: torch.Tensor) -> None:
        rc = client.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if rc != 0:
            raise ConnectionError(f"register_buffer returned {rc}")

    def register_host_buffer(self, buffer: torch.Tensor) -> None:
        """Register the host pool's memory with the transfer engine (needed for RDMA, cheap for TCP)."""
        self._registered.append(buffer)
        if self.client is not None:
            try:
                self._register(self.client, buffer)
            except (ConnectionError, RuntimeError) as err:
                self._error("register host buffer", err)

    def _failed(self, what: str, err: BaseException) -> None:
        self._error(f"{what} via master {self.master}", err)
        self.backoff.failed()

    def _judge(self, what: str, codes: list[int], ok_codes: tuple[int, ...]) -> None:
        """Back off when every key failed in transport (an RPC error, not a miss); count each failure."""
        failures = [c for c in codes if c < 0 and c not in ok_codes]
        if failures:
            self._error(f"{what} of {len(failures)}/{len(codes)} pages via master {self.master}",
                        ConnectionError(f"error codes {sorted(set(failures))}"))
            self._count(errors=len(failures) - 1)
        if codes and len(failures) == len(codes):
            self.backoff.failed()
        else:
            self.backoff.succeeded()

    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        names = [self.object_key(k) for k in keys]
        client = self._connect() if names else None
        if client is None:
            return 0
        try:
            present = client.batch_is_exist(names)
        except RuntimeError as err:
            self._failed("exists", err)
            return 0
        self._judge("exists", present, ())
        for i, p in enumerate(present):
            if p != 1:
                return i
        return len(present)

    @staticmethod
    def _buffers(addresses: list[int], headers: torch.Tensor) -> list[list[int]]:
        """[payload address, header address] per page: the page, then its row of the header arena."""
        base = headers.data_ptr()
        return [[address, base + i * HEADER_SIZE] for i, address in enumerate(addresses)]

    def _ranges(self, num_pages: int) -> list[tuple[int, int]]:
        """(start, end) of each range of a batch: ``RANGE_NBYTES`` (at most ``_MAX_CALL_PAGES`` pages)."""
        per_range = max(1, min(_MAX_CALL_PAGES, RANGE_NBYTES // self.page_nbytes))
        return [(start, min(start + per_range, num_pages)) for start in range(0, num_pages, per_range)]

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, targets)
        return self._get(keys, [t.data_ptr() for t in targets], views)

    def batch_get_rows(self, keys: list[str], rows: np.ndarray, pages: Any, **kwargs: Any) -> list[bool]:
        """:meth:`batch_get` into host pool rows (an L3 prefetch), their addresses worked out for the whole
        batch at once: no tensor and no checked view a page (those were a tenth of a 1,024-page get). A
        subclass that overrides batch_get gets it as before."""
        if kwargs or type(self).batch_get is not MooncakeStore.batch_get:
            return super().batch_get_rows(keys, rows, pages, **kwargs)
        return self._get(keys, *self._row_addresses(keys, rows, pages))

    def _get(self, keys: list[str], addresses: list[int], views: list[memoryview]) -> list[bool]:
        """Read the pages into ``addresses`` (``views`` of them, checked), in ranges on up to IO_THREADS."""
        ranges = self._ranges(len(keys))

        def get_range(thread: int, start: int, end: int) -> tuple[list[bool], list[tuple[int, PageFormatError]]]:
            return self._get_range(thread, start, keys[start:end], addresses[start:end], views[start:end])
        with self._timed("get"), self._get_lock:
            parts = run_ranges(get_range, ranges, self._helper_pool, IO_THREADS)
            found = [hit for hits, _ in parts for hit in hits]
            return self._rejected([failure for _, failures in parts for failure in failures], keys, found)

    def _get_range(self, thread: int, start: int, keys: list[str], addresses: list[int],
                   views: list[memoryview]) -> tuple[list[bool], list[tuple[int, PageFormatError]]]:
        """Pages ``start...``: those whose replica lies in this client's own segment copied out of it and
        verified in one native pass, the others fetched by one call into ``thread``'s header rows, then
        checked: (found, the whole pages that failed verification); other pages are misses here."""
        client = self._connect()
        if client is None:
            return [False] * len(keys), []
        names = [self.key_prefix + k for k in keys]  # keys checked by batch_get
        found, failures = [False] * len(keys), []
        rest = list(range(len(keys)))
        if self._native is not None and self._endpoint and self.read_in_place:
            rest = self._get_local(client, names, keys, views, found, failures)
        if len(rest) == len(keys):
            found, failures = self._get_remote(client, thread, names, keys, addresses, views)
        elif rest:
            rest_found, rest_failures = self._get_remote(client, thread, *(
                [items[i] for i in rest] for items in (names, keys, addresses, views)))
            for i, hit in zip(rest, rest_found):
                found[i] = hit
            failures += [(rest[j], err) for j, err in rest_failures]
        return found, [(start + i, err) for i, err in failures]

    def _local_blobs(self, client, names: list[str]) -> np.ndarray:
        """Each object's blob address where a whole replica of it lies in this client's own mounted segment
        (memory this process maps: read in place), else 0. A replica removed and its memory reused before
        the copy fails its checksum (the copy hashes what it stores): a miss, never a wrong hit."""
        addresses = np.zeros(len(names), dtype=np.int64)
        try:
            replicas = client.batch_get_replica_desc(names)
        except RuntimeError:
            return addresses
        blob_nbytes = self.format.blob_nbytes
        for i, name in enumerate(names):
            for replica in replicas.get(name, ()):
                if replica.is_memory_replica():
                    buffer = replica.get_memory_descriptor().buffer_descriptor
                    if buffer.transport_endpoint == self._endpoint and buffer.size == blob_nbytes:
                        addresses[i] = buffer.buffer_address
                        break
        return addresses

    def _get_local(self, client, names: list[str], keys: list[str], views: list[memoryview], found: list[bool],
                   failures: list[tuple[int, PageFormatError]]) -> list[int]:
        """Copy and verify the pages held in this client's own segment (one GIL-free pass: each chunk
        hashed as it lands, where the transfer engine's copy and a separate hash make two), marking them in
        ``found`` / ``failures``; returns the indexes of the other pages."""
        addresses = self._local_blobs(client, names)
        local = np.flatnonzero(addresses).tolist()
        if not local:
            return list(range(len(names)))
        for j, error in copied_group(self._native, self.format, addresses[local], [keys[i] for i in local],
                                     [views[i] for i in local]):
            failures.append((local[j], error))
        for i in local:
            found[i] = True  # those failing are turned to misses with the batch's failures
        return np.flatnonzero(addresses == 0).tolist()

    def _get_remote(self, client, thread: int, names: list[str], keys: list[str], addresses: list[int],
                    views: list[memoryview]) -> tuple[list[bool], list[tuple[int, PageFormatError]]]:
        """Pages fetched through the transfer engine in one call into ``thread``'s header rows, then
        checked: (found, (index, error) of the whole pages that failed verification)."""
        found = [False] * len(keys)
        headers = self._get_headers[thread * _MAX_CALL_PAGES:(thread + 1) * _MAX_CALL_PAGES]
        try:
            sizes = client.batch_get_into_multi_buffers(names, self._buffers(addresses, headers),
                                                        [[self.page_nbytes, HEADER_SIZE]] * len(keys))
        except RuntimeError as err:
            self._failed("get", err)
            return found, []
        self._judge("get", sizes, (_NOT_FOUND, _BUFFER_TOO_SMALL))
        rows = headers.numpy()[:len(keys)]  # this thread's own rows: read before its next call reuses them
        whole = [i for i, size in enumerate(sizes) if size == self.format.blob_nbytes]
        failures = self._check_whole(0, whole, keys, rows, views) if whole else []
        for i, (key, view, size) in enumerate(zip(keys, views, sizes)):
            if size == self.format.blob_nbytes:
                found[i] = True
            elif size >= 0 or size == _BUFFER_TOO_SMALL:  # not one of our pages: fails on its length
                found[i] = self._verified(key, rows[i].tobytes(), view[:max(0, size - HEADER_SIZE)])
        return found, failures

    def _check_whole(self, start: int, whole: list[int], keys: list[str], rows: np.ndarray,
                     views: list[memoryview]) -> list[tuple[int, PageFormatError]]:
        """(batch index, error) of the pages ``whole`` (indexes in the range from ``start``) that fail."""
        if self._native is not None:
            return checked_group(self._native, self.format, [start + i for i in whole], [keys[i] for i in whole],
                                 rows[whole], [views[i] for i in whole])
        return verify_group(self.format, [PageCheck(start + i, keys[i], rows[i].tobytes(), views[i], None)
                                          for i in whole])

    def _drop(self, key: str) -> None:
        client = self.client
        if client is not None and client.remove(self.object_key(key), True) not in (0, _NOT_FOUND):
            self._count(errors=1)

    def batch_set(self, keys: list[str], values: list[torch.Tensor],
                  digests: Sequence[int | None] | None = None) -> list[bool]:
        """Store each page (put-if-absent). ``digests``: per page the xxh3-64 of its payload or None (see
        :attr:`PageStore.accepts_digests`), used for unkeyed headers in place of hashing the page."""
        views = self._check_batch(keys, values)
        return self._set(keys, [value.data_ptr() for value in values], views, digests)

    def batch_set_rows(self, keys: list[str], rows: np.ndarray, pages: Any, **kwargs: Any) -> list[bool]:
        """:meth:`batch_set` of host pool rows (a backup), their addresses worked out for the whole batch
        at once: no tensor a page. A subclass that overrides batch_set gets it as before."""
        if set(kwargs) - {"digests"} or type(self).batch_set is not MooncakeStore.batch_set:
            return super().batch_set_rows(keys, rows, pages, **kwargs)
        return self._set(keys, *self._row_addresses(keys, rows, pages), kwargs.get("digests"))

    def _row_addresses(self, keys: list[str], rows: np.ndarray, pages: Any) -> tuple[list[int], list[memoryview]]:
        """The address and a byte view of each row ``pages[i]`` of ``rows`` (checked once for the batch)."""
        index, views = self._row_views(keys, rows, pages)
        return (rows.ctypes.data + index.astype(np.int64) * self.page_nbytes).tolist(), views

    def _set(self, keys: list[str], addresses: list[int], views: list[memoryview],
             digests: Sequence[int | None] | None) -> list[bool]:
        """Put the pages at ``addresses`` (``views`` of them, checked). With every digest given nothing is
        hashed, so the batch goes in calls of up to ``_MAX_CALL_PAGES`` pages on this thread (ranges on two
        threads pay only where a hash overlaps a transfer)."""
        check_digests(keys, digests)
        if not keys:
            return []
        if self._native is None:
            digests = None  # a MAC covers the key and the header fields too: computed here
        with self._timed("set"), self._set_lock:
            client = self._connect()
            if client is None:
                return [False] * len(keys)

            def put_range(thread: int, start: int, end: int) -> list[int]:
                return self._hash_and_put(client, thread, keys[start:end], addresses[start:end], views[start:end],
                                          None if digests is None else digests[start:end])
            if digests is not None and None not in digests:
                calls = range(0, len(keys), _MAX_CALL_PAGES)
                parts = [put_range(0, start, min(start + _MAX_CALL_PAGES, len(keys))) for start in calls]
            else:
                parts = run_ranges(put_range, self._ranges(len(keys)), self._helper_pool, IO_THREADS)
        codes = [code for part in parts for code in part]
        self._judge("put", codes, ())
        done = [code == 0 for code in codes]
        self._count(set_pages=sum(done), set_bytes=sum(done) * self.page_nbytes)
        return done

    def _hash_and_put(self, client, thread: int, keys: list[str], addresses: list[int], views: list[memoryview],
                      digests: Sequence[int | None] | None = None) -> list[int]:
        """The headers of a range (into ``thread``'s rows of the arena), then one put call for it. Pages
        whose digest is given (unkeyed format) are not hashed."""
        rows = self._set_headers[thread * _MAX_CALL_PAGES:(thread + 1) * _MAX_CALL_PAGES]
        if self._native is not None:
            rows.numpy()[:len(keys)] = self.format.filled_headers(keys, self._checksums(views, digests))
        else:
            rows.numpy()[:len(keys)] = np.frombuffer(b"".join([self.format.header(k, v) for k, v in zip(keys, views)]),
                                                     np.uint8).reshape(len(keys), HEADER_SIZE)
        try:
            return client.batch_put_from_multi_buffers(
                [self.key_prefix + k for k in keys],  # keys checked by batch_set
                self._buffers(addresses, rows),
                [[self.page_nbytes, HEADER_SIZE]] * len(keys), self._replicate)
        except RuntimeError as err:
            self._error("put via master " + self.master, err)
            return [_TRANSPORT_ERROR] * len(keys)

    def _checksums(self, views: list[memoryview], digests: Sequence[int | None] | None) -> list[int]:
        """Each payload's xxh3-64: the given digest, else hashed here (one native call for those missing)."""
        if digests is None:
            return self._native.xxh3_many(views)
        missing = [i for i, digest in enumerate(digests) if digest is None]
        if not missing:
            return list(digests)
        checksums = list(digests)
        for i, checksum in zip(missing, self._native.xxh3_many([views[i] for i in missing])):
            checksums[i] = checksum
        return checksums

    def clear(self) -> None:
        client = self._connect()
        if client is None:
            return
        try:
            client.remove_by_regex("^" + re.escape(self.key_prefix), True)
        except RuntimeError as err:
            self._failed("clear", err)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except RuntimeError:
                pass
        super().close()
