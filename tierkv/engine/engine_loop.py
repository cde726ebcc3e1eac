"""The engine thread of a server: it owns the scheduler (the cache's thread contract: one scheduler thread);
request handlers on the asyncio loop hand it jobs and cancellations through queues and await their tokens."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from tierkv.engine.engine import Engine
from tierkv.engine.request import Request

log = logging.getLogger(__name__)

DONE = object()  # delivered once after a job's last token


class QueueFull(Exception):
    """The waiting queue is at its cap; ``waiting`` requests are ahead."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting


@dataclass
class CompletionJob:
    """One request in flight: the engine thread calls ``deliver`` with each TokenOut, then ``DONE``."""

    request: Request
    deliver: Callable[[object], None]
    extra: dict = field(default_factory=dict)


class EngineLoop:
    """Runs the scheduler on its own thread; :meth:`submit` and :meth:`cancel` are safe from any thread.
    ``max_waiting`` caps the requests submitted and not yet running (None: no cap)."""

    def __init__(self, engine: Engine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue[CompletionJob] = queue.Queue()
        self._cancels: queue.Queue[Request] = queue.Queue()
        self._active: list[CompletionJob] = []
        self._in_hand = 0  # a job taken from the inbox, not yet in the scheduler: still waiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-engine", daemon=True)
        self.broken: str | None = None
        self.lock = threading.Lock()  # held while the engine steps, so /metrics reads a consistent view

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not admitted yet (read without the lock: a len() of each queue)."""
        return self._inbox.qsize() + self._in_hand + len(self.engine.scheduler.waiting)

    def submit(self, job: CompletionJob) -> CompletionJob:
        """Hand ``job`` to the engine thread; RuntimeError once the engine broke, QueueFull past the cap."""
        if self.broken:
            raise RuntimeError(self.broken)
        waiting = self.num_waiting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise QueueFull(waiting)
        self._inbox.put(job)
        return job

    def cancel(self, request: Request) -> None:
        """Abort ``request`` on the engine thread before its next step (its client went away)."""
        if not request.finished:
            self._cancels.put(request)

    def _run(self) -> None:
        scheduler = self.engine.scheduler
        while not self._stop.is_set():
            try:
                wait_s = 0 if scheduler.has_work or not self._cancels.empty() else 0.05
                job = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
                self._in_hand = 1
                with self.lock:
                    scheduler.submit(job.request)
                self._in_hand = 0
                self._active.append(job)
                continue  # drain the inbox before stepping so arrivals batch together
            except queue.Empty:
                pass
            self._abort_cancelled()
            if scheduler.has_work:
                self._step()
            for job in [j for j in self._active if j.request.finished]:
                self._active.remove(job)
                job.deliver(DONE)

    def _abort_cancelled(self) -> None:
        while True:
            try:
                request = self._cancels.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.engine.scheduler.abort(request)

    def _step(self) -> None:
        try:
            with self.lock:
                self.engine.scheduler.step()
        except Exception as exc:  # a bug must not hang every client: fail them and stop serving
            log.exception("engine step failed")
            self.broken = f"engine failed: {exc!r}"
            for job in self._active:
                job.request.error, job.request.finished = self.broken, True
            self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for job in self._active:
            job.request.error = job.request.error or "server shutting down"
            job.deliver(DONE)
