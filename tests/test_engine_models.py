"""Models: HF-layout safetensors round trip, config validation, MLA caches only the latent."""

import json

import pytest
import torch

from engine_helpers import MODEL_KINDS, prompts_with_shared_prefix
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.config import PRESETS, ModelConfig, resolve_config
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.loader import build_model, save_checkpoint


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_safetensors_checkpoint_round_trip_gives_same_logits(kind, tmp_path):
    model = build_model(kind)
    save_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == PRESETS[kind].arch
    loaded = build_model(str(tmp_path))
    assert loaded.config.replace(seed=0) == model.config.replace(seed=0)
    prompt = prompts_with_shared_prefix(1, 0, 30)
    a = Engine(model, EngineConfig(mode="none")).generate(prompt, 4)[0]
    b = Engine(loaded, EngineConfig(mode="none")).generate(prompt, 4)[0]
    assert a.output == b.output and torch.equal(a.first_logits, b.first_logits)


def test_hf_parameter_names():
    names = set(build_model("tiny-qwen3").state_dict())
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"} <= names
    mla = set(build_model("tiny-mla").state_dict())
    assert {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight"} <= mla


def test_checkpoint_with_wrong_shapes_is_rejected(tmp_path):
    save_checkpoint(build_model("tiny-llama"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        build_model(str(tmp_path))


def test_seeds_give_different_weights_and_same_seed_same_weights():
    a, b = build_model(PRESETS["tiny-llama"]), build_model(PRESETS["tiny-llama"])
    c = build_model(PRESETS["tiny-llama"].replace(seed=1))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_mla_pool_holds_latent_plus_rope_per_token():
    cfg = PRESETS["tiny-mla"]
    spec = cfg.kv_spec()
    assert spec.attention == "mla" and spec.dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert spec.bytes_per_token == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


@pytest.mark.parametrize("field,value", [("arch", "gpt2"), ("num_heads", 0), ("head_dim", 15),
                                         ("num_kv_heads", 3), ("dtype", "float13")])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field if field != "num_kv_heads" else "num_heads"):
        ModelConfig(**{field: value})


def test_resolve_config_unknown_name():
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_config("no-such-model")


def test_tied_embeddings_round_trip(tmp_path):
    model = build_model(PRESETS["tiny-qwen3"].replace(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(model, tmp_path)
    loaded = build_model(str(tmp_path))
    assert loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("extra", [{"rope_scaling": {"type": "yarn", "factor": 4}}, {"attention_bias": True}])
def test_unsupported_hf_features_are_rejected(extra):
    hf = build_model("tiny-llama").config.to_hf_dict() | extra
    with pytest.raises(ValueError, match=next(iter(extra))):
        ModelConfig.from_hf_dict(hf)
