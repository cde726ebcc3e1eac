"""Continuous batching under memory pressure, request validation, and no leaked slots."""

import pytest

from engine_helpers import assert_same, prompts_with_shared_prefix, reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.request import Request
from tierkv.engine.scheduler import SchedulerConfig
from tierkv.radix import RadixKey


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama")


@pytest.mark.parametrize("mode", ["l1", "l1+l2"])
def test_more_requests_than_l1_holds_all_finish_exactly(model, mode):
    prompts = prompts_with_shared_prefix(8, prefix_len=32, suffix_len=40, seed=5)
    prompts += prompts_with_shared_prefix(4, prefix_len=20, suffix_len=30, seed=6)
    want = reference(model, prompts, 5)
    # 12 requests x ~76 KV tokens need ~900 slots; L1 holds 160, so requests wait and the cache evicts
    engine = Engine(model, EngineConfig(mode=mode, l1_tokens=160, page_size=2, max_running_requests=8))
    requests = [engine.submit(p, 5) for p in prompts]
    max_running = 0
    while engine.scheduler.has_work:
        engine.scheduler.step()
        max_running = max(max_running, len(engine.scheduler.running))
        engine.check_integrity()
    assert max_running >= 2  # batching happened
    for got, w in zip(requests, want):
        assert_same(got, w)
    assert engine.cache.stats.evicted_device_tokens > 0
    assert sum(r.cache_hit_tokens for r in requests) > 0
    engine.cache.flush()
    engine.check_integrity()
    engine.close()


def test_request_too_large_for_l1_fails_cleanly(model):
    engine = Engine(model, EngineConfig(mode="l1", l1_tokens=64))
    big, small = engine.submit(list(range(100)), 4), engine.submit(list(range(10)), 4)
    engine.scheduler.run()
    assert big.error and "KV slots" in big.error and not big.output
    assert small.error is None and len(small.output) == 4
    engine.check_integrity()


def test_eos_stops_early(model):
    ref = reference(model, [list(range(20))], 6)[0]
    engine = Engine(model, EngineConfig(mode="l1"))
    req = engine.scheduler.run([Request(list(range(20)), 6, eos_token_id=ref.output[2])])[0]
    assert req.output == ref.output[:3]
    engine.check_integrity()


def test_timings_are_recorded(model):
    engine = Engine(model, EngineConfig(mode="l1"))
    reqs = engine.generate(prompts_with_shared_prefix(3, 8, 8), 4)
    for r in reqs:
        assert r.ttft_s is not None and r.ttft_s >= 0 and r.decode_tokens_per_s > 0
    assert engine.scheduler.counters.requests_finished == 3 and engine.scheduler.counters.first_tokens == 3


@pytest.mark.parametrize("bad", [dict(max_running_requests=0), dict(chunk_tokens=-1), dict(chunk_tokens=True)])
def test_scheduler_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)


def test_request_rejects_empty_prompt():
    with pytest.raises(ValueError, match="prompt"):
        Request([], 3)


@pytest.mark.parametrize("mode", ["l1", "l1+l2"])
def test_abort_releases_waiting_prefilling_decoding_and_unsubmitted_requests(model, mode):
    """Scheduler.abort (a client went away): the request stops at once wherever it is, its slots and locks
    are released, the KV it computed stays cached (unlocked), and the others still finish exactly."""
    prompts = prompts_with_shared_prefix(4, prefix_len=48, suffix_len=200, seed=9)
    want = reference(model, prompts[:1], 6)[0]
    engine = Engine(model, EngineConfig(mode=mode, l1_tokens=2048, page_size=4, max_running_requests=2,
                                        chunk_tokens=64))
    keep, decoding, prefilling, waiting = [engine.submit(p, 6 if i == 0 else 500) for i, p in enumerate(prompts)]
    early = Request(list(prompts[0]), 4)
    engine.scheduler.abort(early)  # not submitted yet: refused when it is
    engine.scheduler.submit(early)
    engine.scheduler.step()  # keep and decoding run (chunked prefill); prefilling waits
    engine.scheduler.abort(waiting)
    assert waiting.finished and waiting.cancelled and not waiting.output
    while not decoding.output:
        engine.scheduler.step()
    engine.scheduler.abort(decoding)
    engine.scheduler.step()  # prefilling is admitted in decoding's place
    assert prefilling in engine.scheduler.running and prefilling.in_prefill
    engine.scheduler.abort(prefilling)
    engine.check_integrity()
    while engine.scheduler.has_work:
        engine.scheduler.step()
    assert_same(keep, want)
    assert [r.cancelled for r in (early, waiting, decoding, prefilling)] == [True] * 4
    assert engine.scheduler.counters.requests_cancelled == 4 and len(decoding.output) < 500
    engine.cache.flush()
    engine.check_integrity()
    assert engine.cache.tree.protected_size == 0
    assert engine.cache.match_prefix(RadixKey(prompts[1][:100])).device_indices.numel() >= 96  # kept, unlocked
    engine.close()
