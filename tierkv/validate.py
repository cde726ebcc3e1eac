"""Checks shared by every config and key type: each error is a ValueError naming the field and the value.

Types are checked strictly: a bool is not an int, an int is not a bool, a string is not a number, and a
number must be finite (NaN never compares, so a NaN timeout never expires; infinity overflows the
waits it reaches). Each check returns the value so a caller can normalise in one line.
"""

from __future__ import annotations

import math
from typing import Iterable

# Longest wait or backoff any config may ask for (about 11.6 days): far below threading.TIMEOUT_MAX and
# float overflow, so deadlines computed from it (even doubled by a backoff) stay finite.
MAX_SECONDS = 1e6


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is True or False (not 0, 1 or "yes")."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool, not a float) within [minimum, maximum]."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or (minimum is not None and value < minimum) or (maximum is not None and value > maximum)):
        raise ValueError(f"{name} must be an int{_bounds(minimum, maximum, False)}, got {value!r}")
    return value


def check_number(name: str, value: object, minimum: float | None = None, maximum: float | None = None,
                 exclusive_minimum: bool = False) -> float:
    """``value`` as a float if it is a finite int or float (not a bool) within the bounds."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int too large for a float
        number = math.nan
    below = minimum is not None and (number <= minimum if exclusive_minimum else number < minimum)
    if not math.isfinite(number) or below or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be a finite number{_bounds(minimum, maximum, exclusive_minimum)}, "
                         f"got {value!r}")
    return number


def check_seconds(name: str, value: object, positive: bool = False) -> float:
    """A duration in seconds: finite, >= 0 (> 0 when ``positive``) and at most :data:`MAX_SECONDS`."""
    return check_number(name, value, 0.0, MAX_SECONDS, exclusive_minimum=positive)


def check_choice(name: str, value: object, options: Iterable[str]) -> str:
    """``value`` if it is one of the strings ``options``."""
    options = list(options)
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} {value!r} is not one of {options}")
    return value


def check_text(name: str, value: object, allow_empty: bool = True, secret: bool = False) -> str:
    """``value`` if it is a str that encodes as UTF-8 (no lone surrogates), non-empty unless allowed.

    ``secret`` (a storage spec may carry a password): the error shows the value's type, never the value.
    """
    shown = type(value).__name__ if secret else repr(value)
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ValueError(f"{name} must be a {'' if allow_empty else 'non-empty '}str, got {shown}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} {shown} is not encodable as UTF-8: {exc.reason}") from None
    return value


def _bounds(minimum: float | None, maximum: float | None, exclusive_minimum: bool) -> str:
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if exclusive_minimum else '>='} {minimum}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}" if isinstance(maximum, float) else f"<= {maximum}")
    return " " + " and ".join(parts) if parts else ""
