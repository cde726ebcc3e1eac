"""L3: after a restart (a new engine on the same file store) prompts hit pages stored by the first one."""

import pytest

from engine_helpers import MODEL_KINDS, assert_same, prompts_with_shared_prefix, reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig

MAX_NEW = 5


def l3_engine(model, store_dir, policy="wait_complete", page_size=4):
    extra = {"prefetch_threshold": 8, "prefetch_stop_policy": policy}
    return Engine(model, EngineConfig(mode="l1+l2+l3", l1_tokens=256, page_size=page_size,
                                      host_layout="page_first", l3=f"file:{store_dir}", storage_extra=extra))


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_hits_from_l3_after_restart_are_exact(kind, tmp_path):
    model = tiny_model(kind)
    prompts = prompts_with_shared_prefix(3, prefix_len=64, suffix_len=10, seed=8)
    want = reference(model, prompts, MAX_NEW)
    first = l3_engine(model, tmp_path)
    for got, w in zip(first.generate(prompts[:1], MAX_NEW), want):
        assert_same(got, w)
    first.close()  # flushes the backups to L3
    second = l3_engine(model, tmp_path)
    got = second.generate(prompts[1:2], MAX_NEW) + second.generate(prompts[2:], MAX_NEW)
    assert got[0].storage_hit_tokens >= 64
    for g, w in zip(got, want[1:]):
        assert_same(g, w)
    second.cache.flush()
    second.check_integrity()
    assert second.scheduler.counters.storage_hit_tokens >= 64
    second.close()


def test_best_effort_policy_finishes_exactly(tmp_path):
    model = tiny_model("tiny-llama")
    prompts = prompts_with_shared_prefix(4, prefix_len=48, suffix_len=8, seed=9)
    want = reference(model, prompts, MAX_NEW)
    first = l3_engine(model, tmp_path, "best_effort", page_size=1)
    first.generate(prompts[:1], MAX_NEW)
    first.close()
    second = l3_engine(model, tmp_path, "best_effort", page_size=1)
    for g, w in zip(second.generate(prompts, MAX_NEW), want):
        assert_same(g, w)
    second.cache.flush()
    second.check_integrity()
    second.close()
