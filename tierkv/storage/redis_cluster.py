"""Page store on a Redis Cluster through redis-py's ``RedisCluster`` (``redis+cluster://host:port``).

The client learns the slot map from any node it is given, sends each key to the master owning its
slot (following MOVED/ASK itself) and splits pipelines per node. Pages, keys, verification and the
read/write backoffs are those of :class:`tierkv.storage.redis_store.RedisStore`; only the transport
differs: a SET carries the page and its header joined in one buffer (the per-node pipelines need whole
values), and the client is created on first use, so an unreachable cluster is a counted miss, not an
error at start. A master that dies makes the batches touching its slots fail (a miss, then a backoff);
start the nodes with ``cluster-require-full-coverage no`` so the other masters keep serving.
"""

from __future__ import annotations

import threading

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from tierkv.storage.overlap import Headers
from tierkv.storage.redis_store import RedisStore


class RedisClusterStore(RedisStore):
    """A namespace of pages spread over a Redis Cluster's masters by key slot."""

    name = "redis-cluster"

    def _make_client(self, host: str, port: int, db: int, username: str | None, password: str | None,
                     timeout_s: float):
        if db != 0:
            raise ValueError(f"redis cluster has only db 0, got db {db!r}")
        self._client_args = dict(host=host, port=port, username=username, password=password,
                                 socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 retry=Retry(NoBackoff(), 0), require_full_coverage=False)
        self._client_lock = threading.Lock()
        return None

    @property
    def client(self) -> RedisCluster:
        """The cluster client, connected on first use; redis.ConnectionError if no node answers."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = RedisCluster(**self._client_args)
                except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as err:
                    raise redis.ConnectionError(f"cluster unreachable: {type(err).__name__}: {err}") from None
            return self._client

    @client.setter
    def client(self, value) -> None:
        self._client = value

    def _streams(self) -> bool:
        return False  # the per-node pipelines need whole values: headers come from the helpers

    def _send_sets(self, keys: list[str], names: list[bytes], views: list[memoryview], headers: Headers
                   ) -> tuple[list[bool], redis.ResponseError | None]:
        done: list[bool] = []
        refusal = None
        ttl_s = self._ttl_s
        for start in range(0, len(keys), self.batch_pages):
            pipe = self.client.pipeline()
            end = start + self.batch_pages
            for i in range(start, min(len(keys), end)):
                pipe.set(names[i], b"".join((views[i], headers.get(i))), ex=ttl_s)
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, redis.ResponseError):
                    refusal = reply
                elif isinstance(reply, Exception):
                    raise reply  # the node is gone: the caller backs off both directions
                done.append(not isinstance(reply, Exception))
            if refusal is not None:
                break
        return done + [False] * (len(keys) - len(done)), refusal

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (redis.RedisError, OSError):
                pass
        super().close()
