"""Greedy outputs with the cache on (hits from L1, from L2 after eviction) equal those with it off."""

import pytest

from engine_helpers import MODEL_KINDS, assert_same, prompts_with_shared_prefix, reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig

MAX_NEW = 6


@pytest.fixture(scope="module", params=MODEL_KINDS)
def model(request):
    return tiny_model(request.param)


def test_l1_hits_are_exact(model):
    prompts = prompts_with_shared_prefix(4, prefix_len=48, suffix_len=9, seed=1)
    want = reference(model, prompts, MAX_NEW)
    engine = Engine(model, EngineConfig(mode="l1", l1_tokens=1024))
    first = engine.generate(prompts[:1], MAX_NEW)
    rest = engine.generate(prompts[1:] + prompts[:1], MAX_NEW)
    assert all(r.device_hit_tokens >= 48 for r in rest)
    for got, w in zip(first + rest, want + want[:1]):
        assert_same(got, w)
    engine.check_integrity()
    engine.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_l2_hits_after_eviction_are_exact(model, page_size):
    prompts = prompts_with_shared_prefix(2, prefix_len=64, suffix_len=7, seed=2)
    fillers = prompts_with_shared_prefix(6, prefix_len=0, suffix_len=60, seed=3)
    want = reference(model, prompts, MAX_NEW)
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=192, page_size=page_size, hicache_ratio=4.0))
    got = engine.generate(prompts[:1], MAX_NEW)
    engine.cache.flush()  # the write-through backup of the first prompt has landed in L2
    engine.generate(fillers, MAX_NEW)  # evicts it from L1
    engine.cache.flush()
    got += engine.generate(prompts[1:] + prompts[:1], MAX_NEW)
    assert got[1].host_hit_tokens >= 60 and got[2].cache_hit_tokens >= 64
    for g, w in zip(got, want + want[:1]):
        assert_same(g, w)
    engine.cache.flush()
    engine.check_integrity()
    engine.close()


def test_chunked_prefill_is_exact(model):
    prompts = prompts_with_shared_prefix(3, prefix_len=40, suffix_len=50, seed=4)
    want = reference(model, prompts, MAX_NEW)
    engine = Engine(model, EngineConfig(mode="l1", l1_tokens=1024, chunk_tokens=16))
    for g, w in zip(engine.generate(prompts, MAX_NEW), want):
        assert_same(g, w)
    engine.check_integrity()
    engine.close()


def test_multi_turn_conversation_reuses_whole_history(model):
    history, *messages = prompts_with_shared_prefix(4, prefix_len=0, suffix_len=20, seed=7)
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=512))
    for turn in range(3):
        got = engine.generate([history], MAX_NEW)[0]
        assert_same(got, reference(model, [history], MAX_NEW)[0])
        if turn:
            assert got.cache_hit_tokens == len(history) - 1 - 20  # all but the new user message
        history = history + got.output + messages[turn]
    engine.check_integrity()
    engine.close()


def test_exclusive_tiers_load_back_in_chunks_exactly(model):
    """Exclusive tiers (L2 holds what L1 dropped): a prefix demoted to a full L2 comes back in chunks
    (tierkv.cache.chunked_load), and the outputs are those of no cache."""
    prompt = prompts_with_shared_prefix(1, prefix_len=320, suffix_len=7, seed=5)
    fillers = prompts_with_shared_prefix(6, prefix_len=0, suffix_len=200, seed=6)
    want = reference(model, prompt, MAX_NEW)
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=512, page_size=16, hicache_ratio=1.5,
                                        tier_mode="exclusive"))
    chunks = []
    load_now = engine.cache.transfer.load_now
    engine.cache.transfer.load_now = lambda *args: chunks.append(args) or load_now(*args)
    got = engine.generate(prompt, MAX_NEW)
    engine.generate(fillers, MAX_NEW)  # demotes the prompt to L2 and fills L2
    assert engine.cache.host_pool.num_free_slots - engine.cache.config.staging_tokens < 256
    got += engine.generate(prompt, MAX_NEW)
    assert got[1].host_hit_tokens >= 256 and len(chunks) >= 2
    for g in got:
        assert_same(g, want[0])
    engine.check_integrity()
    engine.close()
