"""L1 <-> L2 copies: both io backends, every host layout, asynchronous handles and ack queues."""

import logging
import threading
import time
from collections import deque
from functools import partial

import pytest
import torch

from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, HostKVPool, KVSpec
from tierkv.copy.transfer import (CopyHandle, TransferController, _CopyWorker, copy_layer, copy_pages, page_runs,
                             resolve_host_layout)

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=3, dtype=torch.float32)


def _pools(layout: str, page_size: int = 2, spec: KVSpec = SPEC):
    device = DeviceKVPool(spec, 32, page_size, "cpu")
    host = HostKVPool(spec, 64, page_size, layout, pin_memory=False)
    return device, host


def _fill(pool, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = pool.spec
    kv = torch.randn((s.num_kv, s.num_layers, len(slots), s.heads, s.dim), generator=g).to(s.dtype)
    pool.write_tokens(slots, kv)
    return kv


def test_page_runs_merge_consecutive_pages_on_both_sides():
    assert page_runs([0, 1, 2, 7, 8, 3], [5, 6, 7, 1, 2, 3]) == [(0, 5, 3), (7, 1, 2), (3, 3, 1)]
    assert page_runs([], []) == []


# many scattered pages take the gather/scatter path, few runs the run path: cover both
@pytest.mark.parametrize("pattern", ["runs", "scattered"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_copy_pages_round_trip(layout, io_backend, pattern, cpu_copy_impl):
    device, host = _pools(layout)
    if pattern == "runs":
        src, dst = torch.arange(4, 12), torch.arange(20, 28)
    else:
        src = torch.tensor([6, 7, 0, 1, 12, 13, 2, 3, 30, 31, 18, 19, 8, 9, 26, 27, 4, 5, 22, 23])
        dst = torch.tensor([40, 41, 2, 3, 16, 17, 60, 61, 8, 9, 50, 51, 10, 11, 30, 31, 0, 1, 4, 5])
    kv = _fill(device, src)
    pd = device.allocator.slots_to_pages
    ph = host.allocator.slots_to_pages
    copy_pages(device, pd(src), host, ph(dst), io_backend)
    assert torch.equal(host.read_tokens(dst), kv)
    back = torch.arange(len(src)).flip(0).view(-1, 2).flip(1).reshape(-1)  # other slots, reversed pages
    copy_pages(host, ph(dst), device, pd(back), io_backend)
    assert torch.equal(device.read_tokens(back), kv)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_controller_write_then_load_acks_in_order(layout, io_backend):
    device, host = _pools(resolve_host_layout(layout, io_backend))
    tc = TransferController(device, host, io_backend)
    try:
        src = torch.arange(8)
        kv = _fill(device, src, seed=3)
        h1 = tc.write(src[:4], torch.arange(10, 14), payload="w1")
        h2 = tc.write(src[4:], torch.arange(20, 24), payload="w2")
        assert h1.wait(5) and h2.wait(5)
        assert tc.num_done(tc.writes) == 2
        assert [p for _, p in tc.pop_done(tc.writes, 2)] == ["w1", "w2"]
        h3 = tc.load(torch.cat([torch.arange(20, 24), torch.arange(10, 14)]), torch.arange(16, 24), "l1")
        tc.synchronize()
        assert h3.done() and h3.error is None
        assert [p for _, p in tc.pop_done(tc.loads, 1)] == ["l1"]
        assert torch.equal(device.read_tokens(torch.arange(16, 24)), torch.cat([kv[:, :, 4:], kv[:, :, :4]], 2))
    finally:
        tc.shutdown()


def test_acks_stop_at_the_first_pending_copy():
    device, host = _pools("layer_first")
    tc = TransferController(device, host)
    gate = threading.Event()
    tc.delay_hook = lambda kind: gate.wait(5)
    try:
        tc.write(torch.arange(2), torch.arange(2), "a")
        tc.write(torch.arange(2, 4), torch.arange(2, 4), "b")
        assert tc.num_done(tc.writes) == 0
        gate.set()
        tc.synchronize()
        assert tc.num_done(tc.writes) == 2
    finally:
        tc.shutdown()


def test_failed_copy_is_reported_on_its_handle():
    device, host = _pools("layer_first")
    tc = TransferController(device, host)

    def fail(kind):
        raise OSError("injected")

    tc.delay_hook = fail
    try:
        handle = tc.write(torch.arange(2), torch.arange(2))
        assert handle.wait(5)
        assert isinstance(handle.error, OSError)
        ok = tc.write_now(torch.arange(2), torch.arange(2))
        assert ok is None  # write_now runs on the caller's thread, without the hook
    finally:
        tc.shutdown()


def test_mismatched_lengths_are_rejected():
    device, host = _pools("layer_first")
    tc = TransferController(device, host)
    try:
        with pytest.raises(ValueError, match="slots"):
            tc.write(torch.arange(4), torch.arange(2))
    finally:
        tc.shutdown()


def test_direct_with_page_first_becomes_page_first_direct_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tierkv.copy.transfer"):
        assert resolve_host_layout("page_first", "direct") == "page_first_direct"
    assert any("page_first_direct" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.copy.transfer"):
        assert resolve_host_layout("page_first", "kernel") == "page_first"
        assert resolve_host_layout("layer_first", "direct") == "layer_first"
    assert not caplog.records


def test_unknown_io_backend_is_rejected():
    with pytest.raises(ValueError, match="'dma'"):
        resolve_host_layout("layer_first", "dma")
    device, host = _pools("layer_first")
    with pytest.raises(ValueError, match="'dma'"):
        TransferController(device, host, "dma")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("pattern", ["fragmented_to_run", "shuffled_to_run", "run_to_fragmented",
                                     "both_fragmented"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec", [SPEC, KVSpec(num_layers=3, attention="mla", kv_lora_rank=5, rope_dim=0,
                                                dtype=torch.bfloat16)], ids=["mha", "mla-odd-rows"])
def test_row_copies_match_a_reference_copy(spec, layout, pattern, page_size, cpu_copy_impl):
    """Every path of the kernel backend (native chunks; segments on either side, staging) moves exactly
    the right bytes."""
    device = DeviceKVPool(spec, 64 * page_size, page_size, "cpu")
    host = HostKVPool(spec, 128 * page_size, page_size, layout, pin_memory=False)
    g = torch.Generator().manual_seed(len(pattern))
    n = 24
    fragmented = torch.randperm(64, generator=g)[:n].sort().values
    shuffled = torch.randperm(64, generator=g)[:n]
    run = torch.arange(70, 70 + n)
    host_fragmented = torch.randperm(128, generator=g)[:n].sort().values
    src_pages, dst_pages = {
        "fragmented_to_run": (fragmented, run), "shuffled_to_run": (shuffled, run),
        "run_to_fragmented": (run, fragmented), "both_fragmented": (fragmented, host_fragmented)}[pattern]
    for pool in (device, host):
        pool.buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.buffer.view(torch.uint8).shape,
                                                          dtype=torch.uint8, generator=g))
    src, dst = (device, host) if pattern != "run_to_fragmented" else (host, device)
    before = dst.buffer.clone()
    copy_pages(src, src_pages, dst, dst_pages, "kernel")
    got = dst.buffer.clone()
    dst.buffer.copy_(before)
    dst.scatter_pages(dst_pages, src.gather_pages(src_pages))  # the reference: canonical gather/scatter
    assert torch.equal(got.view(torch.uint8), dst.buffer.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), before.view(torch.uint8))


def test_small_cpu_copy_completes_at_once_but_is_still_acknowledged_through_the_queue():
    device, host = _pools("page_first")
    tc = TransferController(device, host)
    try:
        kv = _fill(device, torch.arange(4), seed=5)
        handle = tc.write(torch.arange(4), torch.arange(8, 12), payload="w")
        assert handle.done() and handle.error is None  # copied inline: a hand-off costs more
        assert [p for _, p in tc.pop_done(tc.writes, tc.num_done(tc.writes))] == ["w"]
        assert torch.equal(host.read_tokens(torch.arange(8, 12)), kv)
    finally:
        tc.shutdown()


def test_small_copy_never_overtakes_a_queued_one():
    device, host = _pools("layer_first")
    tc = TransferController(device, host)
    gate, entered = threading.Event(), threading.Event()
    tc.delay_hook = lambda kind: (entered.set(), gate.wait(5))
    try:
        _fill(device, torch.arange(2), seed=1)
        first = tc.write(torch.arange(2), torch.arange(2), "a")
        assert entered.wait(5)  # the worker holds the first copy; later copies are not delayed
        tc.delay_hook = None
        kv = _fill(device, torch.arange(2), seed=2)  # the queued copy must still see these values
        second = tc.load(torch.arange(2), torch.arange(2, 4), "b")
        assert not second.done()  # behind the gated copy, not run inline ahead of it
        gate.set()
        tc.synchronize()
        assert first.error is None and second.error is None
        assert torch.equal(device.read_tokens(torch.arange(2, 4)), kv)
    finally:
        tc.shutdown()


WIDE_SPECS = {"mha": KVSpec(num_layers=2, kv_heads=8, head_dim=128, dtype=torch.float16),  # 8 KiB a token
              "mla": KVSpec(num_layers=3, attention="mla", kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)}


def _random_bytes(*pools, seed=0):
    g = torch.Generator().manual_seed(seed)
    for pool in pools:
        pool.rows.copy_(torch.randint(0, 256, pool.rows.shape, dtype=torch.uint8, generator=g))


def _expected_rows(src, src_pages, dst, dst_pages):
    """The destination's bytes after the copy, by one index op over token rows (the bench's baseline)."""
    expected = dst.rows.clone()
    order = dst.row_dim_order
    expected[dst.page_rows(dst_pages).permute(order).reshape(-1)] = torch.index_select(
        src.rows, 0, src.page_rows(src_pages).permute(order).reshape(-1))
    return expected


@pytest.mark.parametrize("num_tokens", [16, 96], ids=["inline", "over_the_inline_size"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec_name", sorted(WIDE_SPECS))
def test_controller_copies_equal_the_reference_gather(spec_name, layout, page_size, num_tokens, cpu_copy_impl):
    """write (inline, or handed off and taken back by the waiting thread), write_now and load move
    exactly the bytes of one index op over the same pages: scattered L1 pages, runs in L2."""
    spec = WIDE_SPECS[spec_name]
    device = DeviceKVPool(spec, 256, page_size, "cpu")
    host = HostKVPool(spec, 512, page_size, layout, pin_memory=False)
    _random_bytes(device, host, seed=page_size)
    g = torch.Generator().manual_seed(num_tokens)
    num_pages = num_tokens // page_size
    device_pages = torch.randperm(device.num_pages, generator=g)[:num_pages]
    half = num_pages // 2
    host_pages = torch.cat([torch.arange(2, 2 + half), torch.arange(half + 5, num_pages + 5)])  # two runs
    device_slots, host_slots = device.allocator.pages_to_slots(device_pages), host.allocator.pages_to_slots(host_pages)
    tc = TransferController(device, host)
    try:
        expected_host = _expected_rows(device, device_pages, host, host_pages)
        assert tc.write(device_slots, host_slots, "w").wait() and tc.pop_done(tc.writes, 1)[0][0].error is None
        assert torch.equal(host.rows, expected_host)
        _random_bytes(host, seed=1)
        expected_host = _expected_rows(device, device_pages, host, host_pages)
        assert tc.write_now(device_slots, host_slots) is None
        assert torch.equal(host.rows, expected_host)
        _random_bytes(host, seed=2)
        expected_device = _expected_rows(host, host_pages, device, device_pages)
        handle = tc.load(host_slots, device_slots, "l")
        assert handle.wait() and handle.error is None
        assert torch.equal(device.rows, expected_device)
    finally:
        tc.shutdown()


def test_a_load_runs_on_the_calling_thread_when_nothing_is_queued():
    """Every caller waits for a load at once: a hand-off to the copy thread would only add its cost."""
    spec = WIDE_SPECS["mha"]
    device, host = DeviceKVPool(spec, 256, 1, "cpu"), HostKVPool(spec, 512, 1, pin_memory=False)
    tc = TransferController(device, host)
    try:
        handle = tc.load(torch.arange(64), torch.arange(64))  # 512 KiB: over the inline size of a write
        assert handle.done() and handle.error is None
    finally:
        tc.shutdown()


def test_a_failed_inline_load_gets_a_handle_of_its_own_and_later_loads_succeed():
    """Copies run here that succeed share one completed handle: a failure must never land on it."""
    device, host = _pools("page_first")
    tc = TransferController(device, host)
    copier = tc._cpu_copies["load"]
    try:
        copier.run_now = lambda src, dst: (_ for _ in ()).throw(OSError("injected"))
        failed = tc.load(torch.arange(2), torch.arange(2), payload="bad")
        del copier.run_now  # the class's method again
        ok = tc.load(torch.arange(2), torch.arange(2, 4), payload="good")
        assert isinstance(failed.error, OSError) and failed.done() and failed.wait()
        assert ok.error is None and ok.done() and ok is not failed
        acks = tc.pop_done(tc.loads, tc.num_done(tc.loads))
        assert [(handle.error is None, payload) for handle, payload in acks] == [(False, "bad"), (True, "good")]
        assert tc.load(torch.arange(2), torch.arange(4, 6)).error is None
    finally:
        tc.shutdown()


class _SlowTakeDeque(deque):
    """A job queue whose pop leaves the GIL right after taking a job: the thread switch that idle()'s
    lock-free read must survive, made certain."""

    def popleft(self):
        item = super().popleft()
        time.sleep(0.001)
        return item


@pytest.mark.parametrize("taker", ["worker", "waiting thread"])
def test_worker_idle_is_never_true_while_a_copy_is_queued_or_running(taker):
    """idle() reads the queue and the busy flag without the lock; whoever takes a job marks the worker busy
    before taking it, so an idle answer always means every submitted job has finished."""
    worker = _CopyWorker()
    worker._jobs = _SlowTakeDeque()
    finished = []
    try:
        for burst in range(20):
            handle = CopyHandle()
            worker.submit(handle, partial(finished.append, burst))
            if taker == "waiting thread":
                threading.Thread(target=worker.run_until, args=(handle,)).start()
            while not worker.idle():
                time.sleep(0)
            assert finished[-1:] == [burst], f"idle with job {burst} unfinished"
    finally:
        worker.stop(timeout_s=10)


def test_queued_copies_run_one_at_a_time_in_order_when_waiters_take_them():
    """Copies taken back by a waiting thread and copies run by the worker never overlap or reorder."""
    worker = _CopyWorker()
    ran, running, overlapped = [], [], []

    def job(i, handle):
        def run():
            running.append(i)
            overlapped.append(len(running) > 1)
            time.sleep(0.0002)  # widen the window in which an overlap would show
            ran.append(i)
            running.remove(i)
            handle.cpu_event.set()
        return run

    handles = []
    try:
        for i in range(120):
            handle = CopyHandle()
            worker.submit(handle, job(i, handle))
            handle.run_here = partial(worker.run_until, handle)
            handles.append(handle)
            if i % 3 == 2:
                assert handles[i - 1].wait()
    finally:
        worker.stop(timeout_s=10)
    assert all(h.done() for h in handles)
    assert ran == list(range(120)) and not any(overlapped)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec", [SPEC, WIDE_SPECS["mla"]], ids=["mha", "mla"])
def test_staged_layer_copy_moves_exactly_one_layer(spec, layout, page_size):
    """copy_layer (the accelerator's layer-wise load: a host gather into a staging buffer, one copy, a
    device scatter) run here with both pools on the CPU."""
    device = DeviceKVPool(spec, 16 * page_size, page_size, "cpu")
    host = HostKVPool(spec, 32 * page_size, page_size, layout, pin_memory=False)
    _random_bytes(device, host, seed=3)
    host_pages, device_pages = torch.tensor([7, 8, 9, 30, 2]), torch.tensor([4, 0, 11, 12, 5])
    expected = device.gather_pages(device_pages).clone()
    expected[:, 1] = host.gather_pages(host_pages)[:, 1]
    untouched = device.gather_pages(torch.tensor([1, 2, 3])).clone()
    copy_layer(host, host_pages, device, device_pages, 1)
    assert torch.equal(device.gather_pages(device_pages).view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(device.gather_pages(torch.tensor([1, 2, 3])).view(torch.uint8), untouched.view(torch.uint8))


def test_without_write_overlap_a_large_write_runs_on_the_calling_thread():
    """overlap_cpu_writes=False (the replay, which waits for every write at once): a write over the inline
    size is done, and its bytes are in L2, when write() returns; the default hands it to the copy thread."""
    spec = WIDE_SPECS["mha"]
    device, host = DeviceKVPool(spec, 256, 1, "cpu"), HostKVPool(spec, 512, 1, pin_memory=False)
    tc = TransferController(device, host, overlap_writes=False)
    try:
        kv = _fill(device, torch.arange(64), seed=3)
        handle = tc.write(torch.arange(64), torch.arange(100, 164), "w")  # 512 KiB: over the inline size
        assert handle.done() and handle.error is None and handle.run_here is None
        assert torch.equal(host.read_tokens(torch.arange(100, 164)), kv)
        assert [p for _, p in tc.pop_done(tc.writes, tc.num_done(tc.writes))] == ["w"]
    finally:
        tc.shutdown()
    tc = TransferController(device, host)
    try:
        handle = tc.write(torch.arange(64), torch.arange(200, 264), "w")
        assert handle.run_here is not None  # queued for the copy thread
        tc.synchronize()
        assert torch.equal(host.read_tokens(torch.arange(200, 264)), kv)
    finally:
        tc.shutdown()
