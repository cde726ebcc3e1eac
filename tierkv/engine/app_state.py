"""What the HTTP routes need from a server, as plain records: the limits an operator sets and the shared
state (engine loop, tokenizer, keys, metrics). The routes import this module, never the server module,
so the server can import the routes without a cycle."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from tierkv.engine.engine_loop import EngineLoop
from tierkv.engine.metrics import ServerMetrics
from tierkv.engine.tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20
MAX_WAITING_REQUESTS = 1024


@dataclass(frozen=True)
class ServerLimits:
    """``read_timeout_s`` bounds the time a client may take to send a whole request (head and body);
    ``max_connections`` caps open connections (more are answered 503 and closed); ``max_waiting_requests``
    caps the requests queued for admission (more are answered 429 with ``Retry-After``)."""

    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout_s: float = 30.0
    max_connections: int = 1024
    keep_alive_s: float = 5.0
    max_waiting_requests: int = MAX_WAITING_REQUESTS

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "read_timeout_s", "max_connections", "keep_alive_s",
                     "max_waiting_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.max_waiting_requests, int):
            raise ValueError(f"max_waiting_requests must be an int, got {self.max_waiting_requests!r}")


@dataclass
class AppState:
    """The server as its routes see it. ``api_keys`` maps each accepted key to its tenant (None: open)."""

    loop: EngineLoop
    limits: ServerLimits
    model_name: str
    tokenizer: Tokenizer
    api_keys: dict[str, str] | None
    metrics: ServerMetrics
    started_unix: int = field(default_factory=lambda: int(time.time()))
