"""Page store on a Redis Cluster through redis-py's ``RedisCluster`` (``redis+cluster://host:port``).

The client learns the slot map from any node it is given; each batch is split by the master owning
each key's slot and every master gets its share in its own pipelines. A master that fails (dead,
refusing, timing out) costs only its own pages: they are misses (exists stops at the first of them,
reads return False for them, writes return False), and only that master backs off, the others keep
answering. A MOVED reply (the slot map changed) is a miss for that page and refreshes the map once.
Pages, keys, verification and the backoff rule are those of :class:`tierkv.storage.redis_store.RedisStore`;
a SET carries the page and its header joined in one buffer (pipelines need whole values), and the
client is created on first use, so an unreachable cluster is a counted miss, not an error at start.
Start the nodes with ``cluster-require-full-coverage no`` so the other masters keep serving.
"""

from __future__ import annotations

import threading
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from tierkv.storage.base import Backoff
from tierkv.storage.overlap import DigestHeaders, Headers
from tierkv.storage.redis_store import RedisStore

_CLUSTER_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


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
        self._node_backoffs: dict[str, tuple[Backoff, Backoff]] = {}  # per master: (read, write)
        return None

    @property
    def client(self) -> RedisCluster:
        """The cluster client, connected on first use; redis.ConnectionError if no node answers."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = RedisCluster(**self._client_args)
                except _CLUSTER_ERRORS as err:
                    raise redis.ConnectionError(f"cluster unreachable: {type(err).__name__}: {err}") from None
            return self._client

    @client.setter
    def client(self, value) -> None:
        self._client = value

    def _streams(self) -> bool:
        return False  # the pipelines need whole values: headers come from the helpers

    # ---- per-master split ---------------------------------------------------------------------
    def _backoffs(self, node: ClusterNode) -> tuple[Backoff, Backoff]:
        with self._client_lock:
            if node.name not in self._node_backoffs:
                base_s = self.read_backoff.base_s
                self._node_backoffs[node.name] = (Backoff(base_s), Backoff(base_s))
            return self._node_backoffs[node.name]

    def _by_master(self, client: RedisCluster, names: list) -> list[tuple[ClusterNode, list[int]]]:
        """The batch's indices grouped by the master owning each name's slot, in first-seen order; names
        whose slot no master covers are left out (misses)."""
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, name in enumerate(names):
            try:
                node = client.get_node_from_key(name)
            except redis.exceptions.SlotNotCoveredError:
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        return list(groups.values())

    def _per_master(self, what: str, names: list, direction: int,
                    send: Callable[[redis.Redis, list[int]], list]) -> list:
        """``send(node_client, indices)`` once per master for its share, ``batch_pages`` at a time; one
        reply per name, None where its master failed, backs off, or moved the slot. ``direction``: 0
        read, 1 write (a refusal backs off that direction of that master; a dead master both)."""
        replies: list = [None] * len(names)
        try:
            client = self.client
        except redis.ConnectionError as err:  # no node answers at all: the whole store backs off
            self._failed(what, err, self.write_backoff if direction else self.read_backoff)
            return replies
        moved = False
        for node, indices in self._by_master(client, names):
            backoffs = self._backoffs(node)
            if not backoffs[direction].ready():
                self._count(errors=1)
                continue
            try:
                connection = client.get_redis_connection(node)
                for start in range(0, len(indices), self.batch_pages):
                    moved = self._send_chunk(connection, indices[start:start + self.batch_pages], send,
                                             replies) or moved
            except _CLUSTER_ERRORS as err:
                self._error(f"{what} on cluster master {node.name}", err)
                backoffs[direction].failed()
                if not isinstance(err, redis.ResponseError):  # gone: neither direction works
                    backoffs[1 - direction].failed()
                continue
            backoffs[direction].succeeded()
        if moved:
            self._refresh_slots(client)
        return replies

    @staticmethod
    def _send_chunk(connection: redis.Redis, chunk: list[int], send: Callable, replies: list) -> bool:
        """One pipeline of ``chunk`` into ``replies``; True if a slot moved. Raises a refusal (e.g. OOM:
        the master is alive but refuses the rest too) after keeping the replies that came."""
        refused, moved = None, False
        for i, reply in zip(chunk, send(connection, chunk)):
            if not isinstance(reply, Exception):
                replies[i] = reply
            elif str(reply).startswith(("MOVED", "ASK")):  # that slot is served elsewhere now
                moved = True
            else:
                refused = reply
        if refused is not None:
            raise refused
        return moved

    def _refresh_slots(self, client: RedisCluster) -> None:
        try:
            with self._client_lock:
                client.nodes_manager.initialize()
        except _CLUSTER_ERRORS as err:
            self._error("slot map refresh", err)

    # ---- the store's transport ----------------------------------------------------------------
    def _pipelined(self, what: str, command: str, args: list[tuple],
                   on_replies: Callable[[int, list], None] | None = None) -> list | None:
        """Read-only ``command`` per args tuple, per master; None (a miss) for each page whose master failed."""
        if not self._available(self.read_backoff):
            return None

        def send(connection: redis.Redis, indices: list[int]) -> list:
            pipe = connection.pipeline(transaction=False)
            for i in indices:
                pipe.execute_command(command, *args[i])
            return pipe.execute(raise_on_error=False)
        replies = self._per_master(what, [a[0] for a in args], 0, send)
        self.read_backoff.succeeded()  # the cluster answered; each master keeps its own backoff
        if on_replies is not None:
            on_replies(0, replies)
        return replies

    def _send_sets(self, keys: list[str], names: list[bytes], views: list[memoryview],
                   headers: Headers | DigestHeaders
                   ) -> tuple[list[bool], redis.ResponseError | None]:
        """Per master; a master that fails or refuses (OOM) backs off alone and its pages are False."""
        ttl_s = self._ttl_s

        def send(connection: redis.Redis, indices: list[int]) -> list:
            pipe = connection.pipeline(transaction=False)
            for i in indices:
                pipe.set(names[i], b"".join((views[i], headers.get(i))), ex=ttl_s)
            return pipe.execute(raise_on_error=False)
        replies = self._per_master("set", names, 1, send)
        return [reply is not None for reply in replies], None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except _CLUSTER_ERRORS:
                pass
        super().close()
