"""What one scheduler step reports to the cache's cost model: its prefill work and time, and how long
the forward pass waited for L2 -> L1 loads (the part of the loads the layer-wise overlap did not hide)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tierkv.cache.l3.cost_model import CostModel


class TimedLoads:
    """Wraps a :class:`tierkv.cache.layer_load.LayerLoads`, summing the time the forward waited in ``wait_layer``.

    On CPU a wait blocks the host, so the host clock measures it. On CUDA ``wait_layer`` only enqueues a
    stream wait and returns at once: the host clock would read ~0 s and the cost model would see loads as
    free. There a timing event is recorded on the compute stream before and after each wait; the time
    between them is how long the stream stalled on the copy. ``waited_s`` reads them, so call it after the
    forward's kernels are done (``report_step`` synchronizes first).
    """

    def __init__(self, loads: Any, on_cuda: bool = False,
                 new_event: Callable[[], Any] | None = None) -> None:
        self.loads = loads
        self.on_cuda = on_cuda
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._host_waited_s = 0.0
        self._stream_waits: list[tuple[Any, Any]] = []

    def wait_layer(self, layer: int) -> None:
        if self.on_cuda:
            before = self._new_event()
            before.record()
            self.loads.wait_layer(layer)
            after = self._new_event()
            after.record()
            self._stream_waits.append((before, after))
            return
        started_s = time.perf_counter()
        self.loads.wait_layer(layer)
        self._host_waited_s += time.perf_counter() - started_s

    @property
    def waited_s(self) -> float:
        """Seconds the forward waited for loads (on CUDA: read once the recorded events completed)."""
        stalled_ms = sum(before.elapsed_time(after) for before, after in self._stream_waits)
        return self._host_waited_s + stalled_ms / 1000.0


def step_work(items: list) -> tuple[int, float]:
    """New tokens of a pass's work items and the (token, earlier token) pairs their attention covers."""
    num_tokens, pairs = 0, 0.0
    for item in items:
        n, end = len(item.new_token_ids), len(item.kv_slots)
        num_tokens += n
        pairs += n * (2 * end - n - 1) / 2  # positions end - n .. end - 1, summed
    return num_tokens, pairs


def report_step(costs: CostModel, items: list, logits: torch.Tensor, started_s: float,
                loads: TimedLoads | None, loaded_tokens: int) -> None:
    """After a forward pass begun at ``started_s``: its compute time (load waits excluded) per its work,
    and the load waits per token loaded."""
    if logits.is_cuda:  # the time must cover the kernels (the sampler syncs on them right after anyway)
        torch.cuda.synchronize(logits.device)
    elapsed_s = time.perf_counter() - started_s
    waited_s = loads.waited_s if loads is not None else 0.0
    num_tokens, pairs = step_work(items)
    costs.observe_prefill(elapsed_s - waited_s, num_tokens, pairs)
    if loaded_tokens:
        costs.observe_load(waited_s, loaded_tokens)
