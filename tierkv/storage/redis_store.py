"""Page store on Redis or Valkey over TCP: pipelined batches, one string value (payload + header) per page.

Writes send the page's own memory and then its header straight to the socket: pages of 1 MiB or more
(unkeyed) in cache-sized chunks, each hashed just before it is sent; smaller and keyed pages with headers
computed in helper threads; pages whose digest the L1 -> L2 copy made (a backup) with headers filled
from it. Reads copy the reply into the target page while checksumming it in cache-sized chunks (with the
native module, one GIL-free call per round trip's replies); large pages' replies are copied and verified
in helper threads while this thread waits on the next round trip (see :mod:`tierkv.storage.overlap`).

Keys are ``<key_prefix><namespace tag>:<page hash>``, so ``clear`` can SCAN one namespace away. A
connection failure makes the batch a miss (exists/get) or False (set), counts one error and backs off:
calls in the backoff window answer at once without touching the network, then the next call retries
(redis-py reconnects); each further failure doubles the window up to 64 times ``retry_backoff_s``.

Reads and writes back off separately. A server that is gone stops both; a server that answers with an
error stops only that direction. In particular a full server (``maxmemory`` with ``noeviction``
answers SET with ``OOM``) only stops writes: the pages it already holds keep being served. With
``ttl_s`` every page is written with ``SET ... EX ttl_s``; for a bounded Redis prefer ``maxmemory``
with ``allkeys-lru`` or ``allkeys-lfu`` (the server then evicts, and never refuses).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from tierkv.storage import native
from tierkv.storage.base import Backoff, PageStore, check_digests, check_key
from tierkv.storage.overlap import (
    MIN_OVERLAP_PAGE_NBYTES,
    DigestHeaders,
    Headers,
    Verifier,
    copied_group,
)
from tierkv.storage.page_format import PageFormatError

# Unkeyed pages this large are sent in cache-sized chunks, each hashed just before it is sent, so the
# kernel copies it from cache and redis-server never waits for a batch's hashing (hashing a batch
# ahead, on the sending thread or in helpers, left the server idle or took its core: 0.80-0.89 of raw
# at 8 MiB, 1.10-1.28 streamed). Keyed pages keep the helpers: the MAC runs at 0.5-0.8 GB/s, slower
# than the socket, so one sending thread computing it would be the bottleneck.
STREAM_MIN_PAGE_NBYTES = 1 << 20
STREAM_CHUNK_NBYTES = 256 << 10


def _coalesced(pieces: Iterable) -> Iterator:
    """``pieces`` (lazily) with each run of ``bytes`` joined into one: the protocol's words and the pages'
    headers, while page memory (memoryviews) goes as it is, without a copy. redis-py sends each piece it
    is given with its own ``sendall``, and under its TCP_NODELAY each becomes a segment and a read on the
    server: a page's header and tail and the next SET's head now go as one (three sends a page fewer)."""
    small = bytearray()
    for piece in pieces:
        if isinstance(piece, bytes):
            small += piece
            continue
        if small:
            yield bytes(small)
            small.clear()
        yield piece
    if small:
        yield bytes(small)


def _streamed(fmt, key: str, payload: memoryview, tail: bytes, chunk_nbytes: int) -> Iterator:
    """``payload`` in chunks, each fed to the page's hasher as it goes, then the header and ``tail``."""
    state = fmt.payload_hasher(key)
    for start in range(0, len(payload), chunk_nbytes):
        chunk = payload[start:start + chunk_nbytes]
        state.update(chunk)
        yield chunk
    yield fmt.header(key, payload, state) + tail


class RedisStore(PageStore):
    """A namespace of pages in one Redis db. The password is passed to redis-py and never logged."""

    name = "redis"

    def __init__(self, namespace: str, page_nbytes: int, host: str = "127.0.0.1", port: int = 6379,
                 db: int = 0, username: str | None = None, password: str | None = None,
                 key_prefix: str = "tierkv:", timeout_s: float = 5.0, batch_pages: int = 8,
                 retry_backoff_s: float = 0.5, ttl_s: float | None = None,
                 page_key: bytes | str | None = None) -> None:
        super().__init__(namespace, page_nbytes, page_key)
        if timeout_s <= 0:
            raise ValueError(f"redis timeout_s must be > 0, got {timeout_s!r}")
        if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool)
                                      and 1 <= ttl_s < 2 ** 31):
            raise ValueError(f"redis ttl_s must be a number of seconds in [1, 2**31), got {ttl_s!r}")
        if any(c in key_prefix for c in "*?[]\\"):
            raise ValueError(f"redis key_prefix {key_prefix!r} must not contain glob characters *?[]\\")
        if batch_pages < 1:
            raise ValueError(f"redis batch_pages must be >= 1, got {batch_pages!r}")
        self.address = f"{host}:{port}/{db}"
        self.key_prefix = f"{key_prefix}{self.namespace_tag}:"
        self.batch_pages = batch_pages
        # unkeyed pages of at least this many bytes are streamed (None: never; the cluster store's
        # pipelines need whole values), in chunks of this many
        self.stream_min_nbytes: int | None = STREAM_MIN_PAGE_NBYTES
        self.stream_chunk_nbytes = STREAM_CHUNK_NBYTES
        # SET's EX takes whole seconds: round up so a page never expires before ttl_s.
        self._ttl_s = None if ttl_s is None else math.ceil(ttl_s)
        self._expiry = b"" if ttl_s is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (
            len(str(math.ceil(ttl_s))), math.ceil(ttl_s))
        self.read_backoff = Backoff(retry_backoff_s)
        self.write_backoff = Backoff(retry_backoff_s)
        self.client = self._make_client(host, port, db, username, password, timeout_s)
        # unkeyed pages read with the native module: copied and checksummed in one pass
        self._native = native.pageio if self.format.page_key is None else None
        # xxh3 headers can take the digests the L1 -> L2 copy made (a MAC is computed here whatever is given)
        self.accepts_digests = self.format.page_key is None
        self._blob_nbytes = self.format.blob_nbytes

    def _make_client(self, host: str, port: int, db: int, username: str | None, password: str | None,
                     timeout_s: float):
        # No library-level retries: a dead server must cost one timeout, then our own backoff.
        return redis.Redis(host=host, port=port, db=db, username=username, password=password,
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                           retry=Retry(NoBackoff(), 0), retry_on_error=[], health_check_interval=0)

    def check_config(self) -> None:
        """One PING: a db index the server refuses is a configuration error (raised); anything else (the
        server down, slow, or not Redis) is left to the backoff, which turns it into misses."""
        try:
            self.client.ping()
        except redis.ResponseError as exc:
            if "DB index" in str(exc):
                raise ValueError(f"redis db {self.address.rsplit('/', 1)[1]} is refused by the server at "
                                 f"{self.address}: {exc}") from None
        except (redis.RedisError, OSError):
            pass

    def redis_key(self, key: str) -> str:
        return self.key_prefix + check_key(key)

    def _available(self, backoff: Backoff) -> bool:
        if backoff.ready():
            return True
        self._count(errors=1)
        return False

    def _failed(self, what: str, err: BaseException, backoff: Backoff) -> None:
        """Count and log ``err``; back off ``backoff``'s direction, or both if the server is unreachable."""
        self._error(f"{what} on {self.address}", err)
        backoff.failed()
        if not isinstance(err, redis.ResponseError):  # gone, refused, timed out: neither direction works
            other = self.write_backoff if backoff is self.read_backoff else self.read_backoff
            other.failed()

    def _pipelined(self, what: str, command: str, args: list[tuple],
                   on_replies: Callable[[int, list], None] | None = None) -> list | None:
        """Run read-only ``command`` once per args tuple, ``batch_pages`` per round trip; None on failure.
        ``on_replies(start, replies)`` sees each round trip's replies as they come."""
        if not self._available(self.read_backoff):
            return None
        replies: list = []
        try:
            for start in range(0, len(args), self.batch_pages):
                pipe = self.client.pipeline(transaction=False)
                for one in args[start:start + self.batch_pages]:
                    pipe.execute_command(command, *one)
                replies += pipe.execute(raise_on_error=True)
                if on_replies is not None:
                    on_replies(start, replies[start:])
        except (redis.RedisError, OSError) as err:
            self._failed(what, err, self.read_backoff)
            return None
        self.read_backoff.succeeded()
        return replies

    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_calls=1)
        names = [(self.redis_key(k),) for k in keys]
        lengths = self._pipelined("exists", "STRLEN", names) if names else []
        if lengths is None:
            return 0
        for i, length in enumerate(lengths):
            if length != self.format.blob_nbytes:
                return i
        return len(lengths)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        return self._get_views(keys, self._check_batch(keys, targets))

    def _get_views(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """:meth:`batch_get` into checked byte views (a tensor's, or a host pool row's: ``batch_get_rows``)."""
        names = [(self.key_prefix + k,) for k in keys]  # keys checked by the caller
        if self._native is not None:
            return self._get_native(keys, names, views)
        verifier = Verifier(self.format, self._helper_pool)

        def land(start: int, blobs: list) -> None:
            for i, blob in enumerate(blobs, start):
                if blob is not None:
                    header, payload = self.format.split(memoryview(blob))
                    verifier.add(i, keys[i], header, payload, target=views[i])
        with self._timed("get"):
            # Large pages are copied and verified by the helpers while the next replies come; small ones
            # after the last reply (copying between round trips measured slower here).
            blobs = self._pipelined("get", "GET", names, land if verifier.overlapped else None) if names else []
            if blobs is not None and not verifier.overlapped:
                land(0, blobs)
            found = [blob is not None for blob in blobs] if blobs is not None else [False] * len(keys)
            return self._rejected(verifier.failures(), keys, found)

    def _get_native(self, keys: list[str], names: list[tuple], views: list[memoryview]) -> list[bool]:
        """:meth:`batch_get` for unkeyed pages with the native module: each round trip's whole replies copied
        into their pages in one GIL-free pass that hashes each chunk as it lands (small pages after the last
        reply, large ones by a helper while the next replies come); a reply of another length fails."""
        jobs: list = []
        failures: list[tuple[int, PageFormatError]] = []

        def land(start: int, blobs: list) -> None:
            whole = [i for i, blob in enumerate(blobs, start) if blob is not None and len(blob) == self._blob_nbytes]
            failures.extend((i, self._wrong_length(keys[i], blob)) for i, blob in enumerate(blobs, start)
                            if blob is not None and len(blob) != self._blob_nbytes)
            if whole:
                job = (self._native, self.format, [blobs[i - start] for i in whole], [keys[i] for i in whole],
                       [views[i] for i in whole])
                jobs.append((whole, self._helper_pool().submit(copied_group, *job) if overlapped else job))
        overlapped = self.page_nbytes >= MIN_OVERLAP_PAGE_NBYTES
        with self._timed("get"):
            try:
                blobs = self._pipelined("get", "GET", names, land if overlapped else None) if names else []
                if blobs is not None and not overlapped:
                    land(0, blobs)
            finally:  # no helper may still write into the pages once this returns
                results = [(whole, job.result() if overlapped else copied_group(*job)) for whole, job in jobs]
            failures += [(whole[j], err) for whole, group in results for j, err in group]
            found = [blob is not None for blob in blobs] if blobs is not None else [False] * len(keys)
            return self._rejected(failures, keys, found)

    def _wrong_length(self, key: str, blob: bytes) -> PageFormatError:
        try:
            self.format.verify(key, *self.format.split(memoryview(blob)))
        except PageFormatError as err:
            return err
        return PageFormatError(f"page {key}: {len(blob)} bytes, expected {self._blob_nbytes}")

    def batch_set(self, keys: list[str], values: list[torch.Tensor],
                  digests: Sequence[int | None] | None = None) -> list[bool]:
        """Store each page. ``digests``: per page the xxh3-64 of its payload or None (see
        :attr:`PageStore.accepts_digests`): unkeyed headers are filled from them, those pages not hashed
        (nor streamed in hashed chunks: the payload goes to the socket whole); a keyed store ignores them."""
        return self._set_views(keys, self._check_batch(keys, values), digests)

    def _set_views(self, keys: list[str], views: list[memoryview],
                   digests: Sequence[int | None] | None = None) -> list[bool]:
        """:meth:`batch_set` of checked byte views (a tensor's, or a host pool row's: ``batch_set_rows``,
        whose digests the base hands on here)."""
        check_digests(keys, digests)
        names = [(self.key_prefix + k).encode() for k in keys]  # keys checked by the caller
        if not names:
            return []
        with self._timed("set"):
            if not self._available(self.write_backoff):
                return [False] * len(keys)
            try:
                if digests is not None and self.accepts_digests:
                    done, refusal = self._send_sets(keys, names, views,
                                                    DigestHeaders(self.format, keys, views, digests))
                elif self._streams():
                    done, refusal = self._send_sets(keys, names, views, None)
                else:
                    with Headers(self.format, keys, views, self._helper_pool) as headers:
                        done, refusal = self._send_sets(keys, names, views, headers)
            except (redis.RedisError, OSError) as err:
                self._failed("set", err, self.write_backoff)
                return [False] * len(keys)
            if refusal is None:
                self.write_backoff.succeeded()
            else:  # e.g. OOM from a full server: it is alive and still serves what it holds
                self._failed(f"set of {len(done) - sum(done)}/{len(done)} pages (refused)", refusal,
                             self.write_backoff)
            self._count(set_pages=sum(done), set_bytes=sum(done) * self.page_nbytes)
            return done

    def _streams(self) -> bool:
        minimum = self.stream_min_nbytes
        return minimum is not None and self.format.payload_nbytes >= minimum and not self.format.keyed

    def _send_sets(self, keys: list[str], names: list[bytes], views: list[memoryview],
                   headers: Headers | DigestHeaders | None
                   ) -> tuple[list[bool], redis.ResponseError | None]:
        """Pipelined SETs packed by hand so the payload goes from the page's memory to the socket
        (redis-py would need header + payload joined into one fresh 8 MiB buffer per page).

        Returns which pages were stored and the last error reply (a refused SET, such as OOM).
        """
        pool = self.client.connection_pool
        conn = pool.get_connection()
        done: list[bool] = []
        refusal = None
        set_words = b"*5\r\n$3\r\nSET" if self._expiry else b"*3\r\n$3\r\nSET"
        tail = b"\r\n" + self._expiry
        try:
            for start in range(0, len(keys), self.batch_pages):
                packed: list[Iterable] = []  # per page: the command's head, then the value and the tail
                end = min(len(keys), start + self.batch_pages)
                for i in range(start, end):
                    packed.append((b"%s\r\n$%d\r\n%s\r\n$%d\r\n"
                                   % (set_words, len(names[i]), names[i], self.format.blob_nbytes),))
                    packed.append(_streamed(self.format, keys[i], views[i], tail, self.stream_chunk_nbytes)
                                  if headers is None else (views[i], headers.get(i), tail))
                conn.send_packed_command(_coalesced(itertools.chain.from_iterable(packed)), check_health=False)
                for _ in range(end - start):
                    try:
                        conn.read_response()  # an error reply is read whole: the connection stays in step
                        done.append(True)
                    except redis.ResponseError as err:
                        done.append(False)
                        refusal = err
                if refusal is not None:  # a full server refuses the rest too: do not send it
                    break
            return done + [False] * (len(keys) - len(done)), refusal
        except BaseException:
            conn.disconnect()  # unread replies would desynchronise the next user of this connection
            raise
        finally:
            pool.release(conn)

    def _drop(self, key: str) -> None:
        try:
            self.client.delete(self.redis_key(key))
        except (redis.RedisError, OSError) as err:
            self._failed("remove corrupt page", err, self.write_backoff)

    def clear(self) -> None:
        """Delete this namespace's pages (SCAN on the prefix); a connection failure is counted, not raised."""
        if not self._available(self.write_backoff):
            return
        try:
            batch = []
            for name in self.client.scan_iter(match=self.key_prefix + "*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self.client.unlink(*batch)
                    batch = []
            if batch:
                self.client.unlink(*batch)
        except (redis.RedisError, OSError) as err:
            self._failed("clear", err, self.write_backoff)
            return
        self.write_backoff.succeeded()

    def close(self) -> None:
        try:
            self.client.close()
        except (redis.RedisError, OSError):
            pass
        super().close()
