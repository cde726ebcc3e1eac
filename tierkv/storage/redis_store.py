"""Page store on Redis or Valkey over TCP: pipelined batches, one string value (payload + header) per page.

Writes send the header and the page's own memory straight to the socket; reads copy the reply into
the target page while checksumming it in cache-sized chunks.

Keys are ``<key_prefix><namespace tag>:<page hash>``, so ``clear`` can SCAN one namespace away. A
connection failure makes the batch a miss (exists/get) or False (set), counts one error and backs off:
calls in the backoff window answer at once without touching the network, then the next call retries
(redis-py reconnects); each further failure doubles the window up to 64 times ``retry_backoff_s``.
"""

from __future__ import annotations

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from tierkv.storage.base import Backoff, PageStore, check_key
from tierkv.storage.page_format import copy_with_checksum


class RedisStore(PageStore):
    """A namespace of pages in one Redis db. The password is passed to redis-py and never logged."""

    name = "redis"

    def __init__(self, namespace: str, page_nbytes: int, host: str = "127.0.0.1", port: int = 6379,
                 db: int = 0, username: str | None = None, password: str | None = None,
                 key_prefix: str = "tierkv:", timeout_s: float = 5.0, batch_pages: int = 8,
                 retry_backoff_s: float = 0.5) -> None:
        super().__init__(namespace, page_nbytes)
        if timeout_s <= 0:
            raise ValueError(f"redis timeout_s must be > 0, got {timeout_s!r}")
        if any(c in key_prefix for c in "*?[]\\"):
            raise ValueError(f"redis key_prefix {key_prefix!r} must not contain glob characters *?[]\\")
        if batch_pages < 1:
            raise ValueError(f"redis batch_pages must be >= 1, got {batch_pages!r}")
        self.address = f"{host}:{port}/{db}"
        self.key_prefix = f"{key_prefix}{self.namespace_tag}:"
        self.batch_pages = batch_pages
        self.backoff = Backoff(retry_backoff_s)
        # No library-level retries: a dead server must cost one timeout, then our own backoff.
        self.client = redis.Redis(host=host, port=port, db=db, username=username, password=password,
                                  socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0), retry_on_error=[], health_check_interval=0)

    def redis_key(self, key: str) -> str:
        return self.key_prefix + check_key(key)

    def _available(self) -> bool:
        if self.backoff.ready():
            return True
        self._count(errors=1)
        return False

    def _failed(self, what: str, err: BaseException) -> None:
        self._error(f"{what} on {self.address}", err)
        self.backoff.failed()

    def _pipelined(self, what: str, command: str, args: list[tuple]) -> list | None:
        """Run ``command`` once per args tuple, ``batch_pages`` per round trip; None on failure."""
        if not self._available():
            return None
        replies: list = []
        try:
            for start in range(0, len(args), self.batch_pages):
                pipe = self.client.pipeline(transaction=False)
                for one in args[start:start + self.batch_pages]:
                    pipe.execute_command(command, *one)
                replies += pipe.execute(raise_on_error=True)
        except (redis.RedisError, OSError) as err:
            self._failed(what, err)
            return None
        self.backoff.succeeded()
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
        views = self._check_batch(keys, targets)
        names = [(self.redis_key(k),) for k in keys]
        with self._timed("get"):
            blobs = self._pipelined("get", "GET", names) if names else []
            if blobs is None:
                return [False] * len(keys)
            return [self._land(key, blob, view) for key, blob, view in zip(keys, blobs, views)]

    def _land(self, key: str, blob: bytes | None, view: memoryview) -> bool:
        if blob is None:
            return False
        header, payload = self.format.split(memoryview(blob))
        payload_checksum = None
        if len(payload) == self.page_nbytes:
            payload_checksum = copy_with_checksum(view, payload)
        if not self._verified(key, header, payload, payload_checksum):
            return False
        self._count(get_pages=1, get_bytes=self.page_nbytes)
        return True

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        views = self._check_batch(keys, values)
        names = [self.redis_key(k).encode() for k in keys]
        if not names:
            return []
        with self._timed("set"):
            if not self._available():
                return [False] * len(keys)
            try:
                self._send_sets(keys, names, views)
            except (redis.RedisError, OSError) as err:
                self._failed("set", err)
                return [False] * len(keys)
            self.backoff.succeeded()
            self._count(set_pages=len(keys), set_bytes=len(keys) * self.page_nbytes)
            return [True] * len(keys)

    def _send_sets(self, keys: list[str], names: list[bytes], views: list[memoryview]) -> None:
        """Pipelined SETs packed by hand so the payload goes from the page's memory to the socket
        (redis-py would need header + payload joined into one fresh 8 MiB buffer per page)."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            for start in range(0, len(keys), self.batch_pages):
                packed: list = []
                for key, name, view in zip(keys[start:start + self.batch_pages],
                                           names[start:start + self.batch_pages],
                                           views[start:start + self.batch_pages]):
                    packed += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                               % (len(name), name, self.format.blob_nbytes),
                               view, self.format.header(key, view), b"\r\n"]
                conn.send_packed_command(packed, check_health=False)
                for _ in range(len(packed) // 4):
                    conn.read_response()
        except BaseException:
            conn.disconnect()  # unread replies would desynchronise the next user of this connection
            raise
        finally:
            pool.release(conn)

    def _drop(self, key: str) -> None:
        try:
            self.client.delete(self.redis_key(key))
        except (redis.RedisError, OSError) as err:
            self._failed("remove corrupt page", err)

    def clear(self) -> None:
        """Delete this namespace's pages (SCAN on the prefix); a connection failure is counted, not raised."""
        if not self._available():
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
            self._failed("clear", err)
            return
        self.backoff.succeeded()

    def close(self) -> None:
        try:
            self.client.close()
        except (redis.RedisError, OSError):
            pass
