"""Pieces every ``tierkv`` command line shares: the help formatter and the argument types.

A module of its own so the replay's parser (tierkv.cli) and the engine's (tierkv.engine.cli) both import
it and never each other.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default once, at the end of its help, and only when there is one worth showing:
    not for switches (False), absent values (None, ""), nor when the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == "" or default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def token_count(text: str) -> int:
    """argparse type: a token count such as 500000, 500k or 1.5M (argparse names the flag in its error)."""
    from tierkv.replay.report import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 to 65535 (0: the system picks a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside [0, 65535]")
    return port
