"""argparse types shared by the command lines (:mod:`tierkv.cli` and :mod:`tierkv.engine.cli`), apart from
both: the top-level one imports the engine's when asked to serve, so the engine's may not import it back."""

from __future__ import annotations

import argparse


def token_count(text: str) -> int:
    """argparse type: a token count such as 500000, 500k or 1.5M (argparse names the flag in its error)."""
    from tierkv.replay.report import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
