"""An interrupt (Ctrl-C, ``sys.exit``) during an L1 <-> L2 copy: it propagates from every entry point, the
copy counts as failed (it may have stopped half-way), and the cache leaks no slot and serves none of its KV."""

import threading

import pytest
import torch

from tests.test_hicache import make_cache, put, same_bits
from tierkv.pools import DeviceKVPool, HostKVPool, KVSpec
from tierkv.radix import RadixKey
from tierkv.copy.transfer import TransferController

INTERRUPTS = [KeyboardInterrupt, SystemExit]


def interrupt_after(run, interrupt: type[BaseException], times: int = 1):
    """``run`` (a copy), then ``interrupt`` the first ``times`` calls: a signal landing as the copy
    returns, its bytes moved or not."""
    calls = []

    def interrupted(*args):
        run(*args)
        calls.append(args)
        if len(calls) <= times:
            raise interrupt()
    return interrupted


@pytest.fixture
def controller():
    spec = KVSpec(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16)
    tc = TransferController(DeviceKVPool(spec, 64, 1, "cpu"), HostKVPool(spec, 128, 1, pin_memory=False))
    yield tc
    tc.shutdown()


@pytest.mark.parametrize("interrupt", INTERRUPTS)
@pytest.mark.parametrize("kind", ["write", "load"])
def test_an_interrupted_copy_run_here_propagates_with_its_failed_ack_queued(controller, kind, interrupt, monkeypatch):
    """The ack goes out first, carrying the error: whatever owns the copy's slots releases them as for
    any failed copy. (It used to end as the handle's error, the interrupt swallowed.)"""
    copy = controller._cpu_copies[kind]
    monkeypatch.setattr(copy, "run_now", interrupt_after(copy.run_now, interrupt))
    with pytest.raises(interrupt):
        getattr(controller, kind)(torch.arange(4), torch.arange(4), "payload")
    acks = controller.writes if kind == "write" else controller.loads
    assert controller.num_done(acks) == 1
    [(handle, payload)] = controller.pop_done(acks, 1)
    assert isinstance(handle.error, interrupt) and payload == "payload"


@pytest.mark.parametrize("interrupt", INTERRUPTS)
def test_write_now_lets_an_interrupt_through(controller, interrupt, monkeypatch):
    copy = controller._cpu_copies["write"]
    monkeypatch.setattr(copy, "run_now", interrupt_after(copy.run_now, interrupt))
    with pytest.raises(interrupt):
        controller.write_now(torch.arange(4), torch.arange(4))


def test_the_copy_thread_outlives_an_interrupt_raised_in_a_copy(controller, monkeypatch):
    """On the copy thread there is no one to raise to: the copy fails on its handle and the next one runs."""
    copy = controller._cpu_copies["write"]
    monkeypatch.setattr(copy, "run", interrupt_after(copy.run, SystemExit))
    gate = threading.Event()
    controller.delay_hook = lambda kind: gate.wait(5)  # hand the copies to the thread
    first = controller.write(torch.arange(4), torch.arange(4))
    second = controller.write(torch.arange(4, 8), torch.arange(4, 8))
    gate.set()
    assert second.wait(5) and second.error is None
    assert isinstance(first.error, SystemExit)


@pytest.mark.parametrize("interrupt", INTERRUPTS)
def test_an_interrupted_write_back_propagates_from_evict_and_leaks_nothing(interrupt, monkeypatch):
    cache = make_cache(write_policy="write_back")
    try:
        put(cache, list(range(4)), seed=1)
        put(cache, list(range(8)), seed=2)
        copy = cache.transfer._cpu_copies["write"]
        monkeypatch.setattr(copy, "run_now", interrupt_after(copy.run_now, interrupt))
        with pytest.raises(interrupt):
            cache.evict(8)
        # settled as a failed write-back: the nodes are gone, not kept in L2 with a half copy
        assert list(cache.tree.nodes()) == [] and cache.stats.failed_copies == 1
        assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
        assert cache.device_pool.num_free_slots == cache.device_pool.num_slots
        cache.check_integrity()
    finally:
        cache.close()


@pytest.mark.parametrize("interrupt", INTERRUPTS)
def test_an_interrupted_load_back_propagates_and_its_kv_is_never_served(interrupt, monkeypatch):
    cache = make_cache(write_policy="write_back", load_back_threshold=0)
    try:
        kv = put(cache, list(range(8)), seed=1)
        assert cache.evict(8) == 8  # written back: L2 only now
        key = RadixKey(list(range(8)))
        copy = cache.transfer._cpu_copies["load"]
        monkeypatch.setattr(copy, "run_now", interrupt_after(copy.run_now, interrupt))
        with pytest.raises(interrupt):
            cache.init_load_back(cache.match_prefix(key).last_host_node)
        assert len(cache.match_prefix(key).device_indices) == 0  # the failed load is no hit
        cache.step()  # its ack: the garbage leaves L1
        cache.check_integrity()
        assert cache.stats.failed_copies == 1 and cache.match_prefix(key).host_hit_length == 8
        load = cache.init_load_back(cache.match_prefix(key).last_host_node)  # the L2 copy is still good
        assert load.pending.wait() and same_bits(cache.device_pool.read_tokens(load.device_indices), kv)
        cache.step()
        cache.check_integrity()
    finally:
        cache.close()
