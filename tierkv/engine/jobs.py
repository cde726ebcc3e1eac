"""What the engine loop (:mod:`tierkv.engine.server`) and the HTTP routes (:mod:`tierkv.engine.routes`) share:
a request in flight, the marker that ends its tokens, and the access log. Apart from both, which import
it, so that neither imports the other back."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from tierkv.engine.request import Request

access_log = logging.getLogger("tierkv.access")
_DONE = object()


@dataclass
class CompletionJob:
    """One request in flight: the engine thread calls ``deliver`` with each TokenOut, then ``_DONE``."""

    request: Request
    deliver: Callable[[object], None]
    extra: dict = field(default_factory=dict)
