"""A background thread that runs storage jobs one at a time, in submission order."""

from __future__ import annotations

import logging
import queue
import threading
from time import monotonic
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class IOWorker:
    """One daemon thread draining a job queue. A job that raises is logged; the thread keeps going.

    A job stuck in a hung backend keeps the thread; :meth:`stop` then gives up after its timeout (the
    daemon thread dies with the process) instead of hanging the caller.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a job reports its own failure; this only keeps the thread alive
                log.exception("storage job failed")

    def stop(self, timeout_s: float) -> bool:
        """Finish queued jobs and end the thread; False if it did not end within ``timeout_s``."""
        return stop_workers([self], timeout_s)


def stop_workers(workers: Iterable[IOWorker], timeout_s: float) -> bool:
    """Stop every worker within one shared ``timeout_s`` (not one each); False if any is still running.

    All are told to stop first, then each join gets what is left of the single deadline, so a close
    with two hung workers waits ``timeout_s`` in all, as the README promises.
    """
    workers = list(workers)
    for worker in workers:
        worker._jobs.put(None)
    deadline = monotonic() + timeout_s
    stopped = True
    for worker in workers:
        worker._thread.join(max(0.0, deadline - monotonic()))
        if worker._thread.is_alive():
            log.warning("%s did not stop within %.1f s (a backend call hangs); leaving it",
                        worker._thread.name, timeout_s)
            stopped = False
    return stopped
