"""The engine's L3 namespace names the weights and every config field that changes KV.

Two checkpoints of one shape with different weights share one L3 directory: each must produce exactly
its own no-cache outputs (before the fix both were "llama-L2-H64-V320-seed0" and the second served the
first one's KV).
"""

import pytest

from engine_helpers import assert_same, prompts_with_shared_prefix, reference
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.config import PRESETS
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.loader import build_model, model_namespace, save_checkpoint, weights_digest

MAX_NEW = 4


def l3_engine(model, store_dir, model_id=None):
    extra = {"prefetch_threshold": 8, "prefetch_stop_policy": "wait_complete"}
    return Engine(model, EngineConfig(mode="l1+l2+l3", l1_tokens=256, page_size=4, host_layout="page_first",
                                      l3=f"file:{store_dir}", storage_extra=extra, model_id=model_id))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of tiny-llama's shape with different random weights (config.json has no seed)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return [str(save_checkpoint(build_model(PRESETS["tiny-llama"].replace(seed=seed)), root / f"ckpt{seed}"))
            for seed in (1, 2)]


def test_two_checkpoints_sharing_one_l3_each_give_their_own_outputs(checkpoints, tmp_path):
    prompts = prompts_with_shared_prefix(2, prefix_len=48, suffix_len=6, seed=12)
    store = tmp_path / "l3"
    namespaces = []
    for path in checkpoints:
        model = build_model(path)
        want = reference(model, prompts, MAX_NEW)
        first = l3_engine(model, store)
        namespaces.append(first.namespace)
        for got, w in zip(first.generate(prompts[:1], MAX_NEW), want):
            assert_same(got, w)
        first.close()  # flushes the backups to the shared L3
        again = l3_engine(build_model(path), store)  # a restart of the same checkpoint: same namespace
        assert again.namespace == namespaces[-1]
        got = again.generate(prompts, MAX_NEW)
        for g, w in zip(got, want):
            assert_same(g, w)
        assert again.scheduler.counters.storage_hit_tokens >= 48  # its own pages do hit
        again.close()
    assert namespaces[0] != namespaces[1]


def test_namespace_changes_with_every_field_and_the_weights():
    base = build_model(PRESETS["tiny-llama"])
    names = {model_namespace(base)}
    for change in ({"rope_theta": 500000.0}, {"rms_norm_eps": 1e-5}, {"max_position": 4096},
                   {"tie_word_embeddings": True}, {"dtype": "bfloat16"}):
        other = build_model(PRESETS["tiny-llama"].replace(**change))
        names.add(model_namespace(other))
    names.add(model_namespace(build_model(PRESETS["tiny-llama"].replace(seed=7))))
    names.add(model_namespace(base, model_id="my-finetune"))
    assert len(names) == 8
    assert model_namespace(base, "my-finetune").startswith("my-finetune-")
    assert model_namespace(build_model(PRESETS["tiny-llama"])) == model_namespace(base)  # stable


def test_rope_theta_alone_changes_the_namespace_with_identical_weights():
    base = build_model(PRESETS["tiny-llama"])
    other = build_model(PRESETS["tiny-llama"].replace(rope_theta=500000.0))
    assert weights_digest(base) == weights_digest(other)
    assert model_namespace(base) != model_namespace(other)


def test_one_weight_changed_changes_the_digest():
    import torch
    model = build_model(PRESETS["tiny-llama"])
    before = weights_digest(model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert weights_digest(model) != before


def test_model_id_reaches_the_engine_namespace(tmp_path):
    model = build_model(PRESETS["tiny-llama"])
    named = l3_engine(model, tmp_path, model_id="team-a/llama-ft")
    plain = l3_engine(model, tmp_path / "other")
    assert named.namespace.startswith("team-a/llama-ft-") and named.namespace != plain.namespace
    named.close()
    plain.close()
