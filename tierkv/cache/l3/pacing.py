"""Backups to L3 wait for a gap between the engine's forward passes.

On a host with few cores, a backup thread writing pages (checking, hashing, creating files: Python that
holds the GIL) slows every forward pass it overlaps, and TTFT with it; the forward pass is what a user
waits for, a backup only what a later request may hit. So the engine marks each forward pass
(:meth:`BackupPacer.busy`), and a backup job starts only when none runs, but never later than
``max_delay_s`` after it was queued: a busy engine still gets its backups, late rather than never.
A cache without an engine (a replay, a test) never marks anything, so its backups start at once.

Thread contract: :meth:`busy` on the scheduler thread; :meth:`paced` jobs run on a worker thread.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

MAX_BACKUP_DELAY_S = 0.2  # a few forward passes: the backup lands before the conversation's next turn


class BackupPacer:
    """Holds backup jobs back while a forward pass runs (see the module docstring)."""

    def __init__(self, max_delay_s: float = MAX_BACKUP_DELAY_S) -> None:
        if not isinstance(max_delay_s, (int, float)) or max_delay_s < 0:
            raise ValueError(f"max_delay_s must be a number >= 0, got {max_delay_s!r}")
        self.max_delay_s = float(max_delay_s)
        self._idle = threading.Event()
        self._idle.set()
        self.delayed_jobs = 0  # jobs that found a forward pass running (worker thread only)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark a forward pass: backups queued meanwhile wait for its end (bounded)."""
        self._idle.clear()
        try:
            yield
        finally:
            self._idle.set()

    def paced(self, job: Callable[[], None]) -> Callable[[], None]:
        """``job`` wrapped to wait, when it comes to run, for no forward pass (at most ``max_delay_s``
        from now, its queueing time)."""
        queued_s = time.monotonic()

        def run() -> None:
            if not self._idle.is_set():
                self.delayed_jobs += 1
                self._idle.wait(max(0.0, self.max_delay_s - (time.monotonic() - queued_s)))
            job()
        return run
