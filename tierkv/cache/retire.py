"""Retire finished in-flight items one by one, so that one that fails strands none of the others.

A retirement releases locks and slots; if one raised out of a loop, every item after it would stay
locked (and its slots owned) for ever. :class:`Retirements` runs each retirement on its own, and
reports the first error once all have run (the others are logged), so a bug still surfaces.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


class Retirements:
    """Collects the errors of independent retirements; :meth:`raise_first` ends the batch."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def run(self, retire: Callable[..., None], *args: Any) -> None:
        try:
            retire(*args)
        except Exception as exc:  # reported by raise_first (or logged below) after the others ran
            if self.errors:
                log.error("retiring %r failed too", args[0] if args else retire, exc_info=exc)
            self.errors.append(exc)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]
