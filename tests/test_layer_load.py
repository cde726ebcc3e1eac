"""Deferred, batched, layer-wise L2 -> L1 loads: the cache's queue and per-layer waits, and the engine
that waits per layer and recomputes a request whose prefix load failed."""

from __future__ import annotations

import threading

import pytest
import torch

from tierkv.copy import transfer
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.radix import RadixKey

from engine_helpers import assert_same, prompts_with_shared_prefix, reference, single_torch_thread, tiny_model  # noqa: F401
from storage_util import compute_and_insert, make_cache, random_tokens

PS = 16


def _host_only(seed: int, num_pages: int = 4, host_layout: str = "page_first"):
    """A cache holding a key's KV in L2 only, the key, and that KV."""
    cache = make_cache(page_size=PS, write_policy="write_through", load_back_threshold=1, host_layout=host_layout)
    key = RadixKey(random_tokens(num_pages * PS, seed=seed))
    kv = compute_and_insert(cache, key, seed=seed + 1)
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    return cache, key, kv


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_deferred_load_starts_with_start_loading(cpu_copy_impl, host_layout):
    cache, key, kv = _host_only(seed=71, host_layout=host_layout)
    result = cache.init_load_back(cache.match_prefix(key).last_host_node, defer=True)
    with pytest.raises(RuntimeError, match="start_loading"):
        result.pending.wait()
    loads = cache.start_loading()
    assert result.pending.handle is not None  # started (and maybe done already: then nothing to wait for)
    for layer in range(cache.device_pool.spec.num_layers):
        loads.wait_layer(layer)
    assert result.pending.wait()
    assert torch.equal(cache.device_pool.read_tokens(result.device_indices), kv)
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_one_batch_for_the_step_and_each_layer_waits_for_its_own_copy(monkeypatch):
    cache, key_a, kv_a = _host_only(seed=72)
    key_b = RadixKey(random_tokens(4 * PS, seed=73))
    kv_b = compute_and_insert(cache, key_b, seed=74)
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    layer_one_may_copy = threading.Event()
    real_copier = transfer.TransferController._cpu_layer_copier

    def gated_copier(self, src_pages, dst_pages):
        copy = real_copier(self, src_pages, dst_pages)

        def gated_copy(layer: int) -> None:
            if layer == 1:
                assert layer_one_may_copy.wait(10)
            copy(layer)
        return gated_copy

    monkeypatch.setattr(transfer.TransferController, "_cpu_layer_copier", gated_copier)
    results = [cache.init_load_back(cache.match_prefix(k).last_host_node, defer=True) for k in (key_a, key_b)]
    loads = cache.start_loading()
    assert len(loads.handles) == 1 and results[0].pending.handle is results[1].pending.handle  # one batch
    loads.wait_layer(0)  # returns while layer 1 is still held back
    assert not results[0].pending.handle.done()
    for result, kv in zip(results, (kv_a, kv_b)):
        layer0 = cache.device_pool.read_tokens(result.device_indices)[:, 0]
        assert torch.equal(layer0, kv[:, 0])
    layer_one_may_copy.set()
    loads.wait_layer(1)
    for result, kv in zip(results, (kv_a, kv_b)):
        assert result.pending.wait()
        assert torch.equal(cache.device_pool.read_tokens(result.device_indices), kv)
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_matching_a_queued_load_starts_it_and_waits():
    cache, key, kv = _host_only(seed=75)
    result = cache.init_load_back(cache.match_prefix(key).last_host_node, defer=True)
    m = cache.match_prefix(key)  # another request reads this prefix now
    assert result.pending.handle is not None and result.pending.handle.done()
    assert torch.equal(cache.device_pool.read_tokens(m.device_indices), kv)
    cache.flush()
    cache.check_integrity()
    cache.close()


def test_a_failed_layerwise_load_reports_failure_and_releases_every_layer_wait():
    cache, key, _ = _host_only(seed=76)
    cache.transfer.delay_hook = lambda kind: (_ for _ in ()).throw(OSError("injected copy failure"))
    result = cache.init_load_back(cache.match_prefix(key).last_host_node, defer=True)
    loads = cache.start_loading()
    for layer in range(cache.device_pool.spec.num_layers):
        loads.wait_layer(layer)  # must not hang
    assert result.pending.wait() is False
    cache.transfer.delay_hook = None
    cache.flush()
    assert cache.stats.failed_copies == 1
    cache.check_integrity()
    cache.close()


def test_engine_recomputes_a_request_whose_layerwise_load_failed():
    model = tiny_model("tiny-llama")
    prompts = prompts_with_shared_prefix(1, prefix_len=64, suffix_len=7, seed=77)
    fillers = prompts_with_shared_prefix(6, prefix_len=0, suffix_len=60, seed=78)
    want = reference(model, prompts, 4)
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=192, page_size=4, hicache_ratio=4.0))
    engine.generate(prompts, 4)
    engine.cache.flush()
    engine.generate(fillers, 4)  # the prompt is now in L2 only
    engine.cache.flush()
    failures = []

    def fail_first_load(kind: str) -> None:
        if kind == "load" and not failures:
            failures.append(kind)
            raise OSError("injected load failure")

    engine.cache.transfer.delay_hook = fail_first_load
    got = engine.generate(prompts, 4)
    assert failures and engine.scheduler.counters.restarted_requests == 1
    assert_same(got[0], want[0])
    engine.cache.transfer.delay_hook = None
    engine.cache.flush()
    engine.check_integrity()
    engine.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_engine_l2_hits_are_exact_both_ways(layerwise: bool):
    model = tiny_model("tiny-qwen3")
    prompts = prompts_with_shared_prefix(3, prefix_len=64, suffix_len=5, seed=79)
    want = reference(model, prompts, 4)
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=192, page_size=4, hicache_ratio=4.0,
                                        layerwise_load=layerwise))
    engine.generate(prompts[:1], 4)
    engine.cache.flush()
    engine.cache.evict(engine.cache.device_pool.num_slots)
    got = engine.generate(prompts, 4)
    assert got[0].host_hit_tokens >= 60
    for g, w in zip(got, want):
        assert_same(g, w)
    engine.cache.flush()
    engine.check_integrity()
    engine.close()
