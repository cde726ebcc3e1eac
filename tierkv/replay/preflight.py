"""Checks `tierkv replay` makes before any work, so a run that cannot finish fails in a second, not after
the whole trace: output files that cannot be written, an L3 that cannot store and read a page, an empty
trace or ``--limit 0``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tierkv.storage.factory import open_store, redact_spec

PROBE_NAMESPACE = "tierkv-replay-preflight"
PROBE_PAGE_NBYTES = 64


def check_output_path(flag: str, path: str | os.PathLike) -> None:
    """Raise ValueError unless ``path`` can be created or overwritten (nothing is left behind)."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory, not a file")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: its folder {str(parent)!r} does not exist")
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)


def check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or limit < 1):
        raise ValueError(f"--limit must be at least 1 request, got {limit}")


def check_requests(trace_path: str, num_requests: int, num_bad_lines: int) -> None:
    if num_requests == 0:
        skipped = f" ({num_bad_lines} bad lines skipped)" if num_bad_lines else ""
        raise ValueError(f"trace {trace_path!r} has no requests to replay{skipped}")


def check_l3(spec: str) -> None:
    """Store one page in ``spec``'s L3 (in a namespace of its own) and read it back; ValueError naming the
    redacted spec if either fails, so an unreachable L3 is refused before the replay rather than counted
    as a run with no L3 hits."""
    store = open_store(spec, PROBE_NAMESPACE, PROBE_PAGE_NBYTES)
    try:
        store.check_config()  # a setting the backend refuses (a Redis db index) has its own message
        page = torch.arange(PROBE_PAGE_NBYTES, dtype=torch.uint8)
        key = "0" * 32
        if store.batch_set([key], [page]) != [True]:
            raise ValueError(f"L3 {redact_spec(spec)}: cannot store a test page (is the server up, the "
                             f"folder writable?)")
        back = torch.zeros_like(page)
        if store.batch_get([key], [back]) != [True] or not torch.equal(back, page):
            raise ValueError(f"L3 {redact_spec(spec)}: a test page stored there does not read back")
        store.clear()
    finally:
        store.close()
