"""HTTP front end: FastAPI + uvicorn, OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``
(plain and SSE streaming), ``/v1/models``, ``/health`` and Prometheus ``/metrics``.

One engine thread owns the engine (:mod:`tierkv.engine.engine_loop`); request handlers on the asyncio loop
hand requests over through a queue and await their tokens. The HTTP/1.1 parser is
uvicorn's h11 protocol, extended with a whole-request read deadline and a cap on open connections.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tierkv.engine.app_state import MAX_BODY_BYTES, AppState, ServerLimits
from tierkv.engine.engine import Engine
from tierkv.engine.engine_loop import EngineLoop
from tierkv.engine.metrics import ServerMetrics
from tierkv.engine.routes import build_app
from tierkv.engine.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["MAX_BODY_BYTES", "CompletionServer", "ServerLimits", "guarded_protocol"]

log = logging.getLogger(__name__)

_BUSY_BODY = b'{"error": {"message": "too many open connections", "type": "server_busy", "param": null, "code": 503}}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"content-length: %d\r\n\r\n" % len(_BUSY_BODY)) + _BUSY_BODY


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a whole-request read deadline and a connection cap (uvicorn has neither:
    a client that never finishes its request would hold its connection for ever)."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning("refused a connection from %s: %d open", self.client, len(self.connections) - 1)
                transport.write(_BUSY)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _read_timed_out(self) -> None:
            if not self.transport.is_closing():
                log.info("closed %s: no complete request within %ss", self.client, limits.read_timeout_s)
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete:
                self._disarm()  # the whole request is in: the response may take as long as it needs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


class CompletionServer:
    """An engine loop plus a uvicorn server; ``port=0`` picks a free port (see :attr:`port`).

    ``api_keys`` maps each accepted API key to its tenant (None: no authentication); each tenant's
    requests, and each ``cache_salt``, get their own cache namespace.
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "tierkv",
                 tokenizer: Tokenizer | None = None, api_keys: dict[str, str] | None = None,
                 limits: ServerLimits | None = None) -> None:
        self.limits = limits or ServerLimits()
        self.loop = EngineLoop(engine, self.limits.max_waiting_requests)
        self.model_name = model_name
        self.tokenizer = tokenizer or ByteTokenizer()
        self.api_keys = api_keys
        self.metrics = ServerMetrics(engine, self.loop.lock)
        self.app = build_app(AppState(self.loop, self.limits, model_name, self.tokenizer, api_keys, self.metrics))
        self.socket = socket.create_server((host, port), reuse_port=False)
        self.socket.setblocking(False)
        config = uvicorn.Config(self.app, http=guarded_protocol(self.limits), loop="asyncio", lifespan="off",
                                access_log=False, log_config=None, backlog=2048, ws="none",
                                timeout_keep_alive=self.limits.keep_alive_s, timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self.socket.getsockname()[0]

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    def start(self) -> "CompletionServer":
        """Serve on a background thread; returns once the socket accepts."""
        self.loop.start()
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                        name="tierkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.uvicorn.started:
            raise RuntimeError("the HTTP server did not start")
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until SIGINT/SIGTERM (uvicorn installs the handlers)."""
        self.loop.start()
        self.uvicorn.run(sockets=[self.socket])

    def close(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.socket.close()
        self.loop.stop()
        self.loop.engine.close()
