"""TimedLoads: the load waits a forward pass reports to the cost model, on CPU (host clock) and on CUDA
(stream timing events, because a CUDA ``wait_layer`` returns at once and the host clock reads ~0 s)."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch

from tierkv.cache.l3.cost_model import CostModel
from tierkv.engine.step_costs import TimedLoads, report_step


class _SleepyLoads:
    def __init__(self, sleep_s: float) -> None:
        self.sleep_s, self.layers = sleep_s, []

    def wait_layer(self, layer: int) -> None:
        self.layers.append(layer)
        time.sleep(self.sleep_s)


class _FakeEvent:
    """Records when it was recorded relative to the wrapped wait; elapsed_time as a CUDA event gives it (ms)."""

    log: ClassVar[list[str]] = []

    def __init__(self, stamp_ms: float) -> None:
        self.stamp_ms = stamp_ms

    def record(self) -> None:
        _FakeEvent.log.append("record")

    def elapsed_time(self, later: _FakeEvent) -> float:
        return later.stamp_ms - self.stamp_ms


class _LoggingLoads:
    def wait_layer(self, layer: int) -> None:
        _FakeEvent.log.append(f"wait {layer}")


def test_host_waits_are_summed_on_cpu():
    loads = _SleepyLoads(0.01)
    timed = TimedLoads(loads)
    for layer in range(3):
        timed.wait_layer(layer)
    assert loads.layers == [0, 1, 2]
    assert timed.waited_s >= 0.03


def test_on_cuda_the_wait_is_the_time_between_events_recorded_around_each_stream_wait():
    stamps = iter([0.0, 4.0, 10.0, 10.5])  # a 4 ms stall on layer 0, 0.5 ms on layer 1
    _FakeEvent.log = []
    timed = TimedLoads(_LoggingLoads(), on_cuda=True, new_event=lambda: _FakeEvent(next(stamps)))
    timed.wait_layer(0)
    timed.wait_layer(1)
    assert _FakeEvent.log == ["record", "wait 0", "record", "record", "wait 1", "record"]
    assert timed.waited_s == pytest.approx(0.0045)


def test_report_step_charges_the_event_measured_wait_to_loads_not_to_compute():
    costs = CostModel()
    stamps = iter([0.0, 20.0])  # the stream stalled 20 ms on the load
    timed = TimedLoads(_LoggingLoads(), on_cuda=True, new_event=lambda: _FakeEvent(next(stamps)))
    timed.wait_layer(0)

    class _Item:
        def __init__(self) -> None:
            self.new_token_ids = self.kv_slots = list(range(100))

    report_step(costs, [_Item()], torch.zeros(1), time.perf_counter() - 0.05, timed, loaded_tokens=1000)
    assert costs.load_s_per_token == pytest.approx(0.020 / 1000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_stall_on_a_copy_stream_is_measured():
    copy_stream = torch.cuda.Stream()
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    done = torch.cuda.Event()

    class _StreamLoads:
        def wait_layer(self, layer: int) -> None:
            torch.cuda.current_stream().wait_event(done)

    with torch.cuda.stream(copy_stream):
        for _ in range(8):
            device.copy_(host, non_blocking=True)
        done.record()
    timed = TimedLoads(_StreamLoads(), on_cuda=True)
    started_s = time.perf_counter()
    timed.wait_layer(0)
    host_s = time.perf_counter() - started_s
    torch.cuda.synchronize()
    assert timed.waited_s > host_s  # 512 MiB over PCIe takes milliseconds; the host call took microseconds
    assert timed.waited_s > 0.001
