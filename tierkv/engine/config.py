"""Model configurations: one frozen dataclass for the three families, tiny presets, HF config.json I/O."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.pools.spec import KVSpec, parse_dtype
from tierkv.validate import check_bool, check_choice, check_int, check_number

ARCHS = ("llama", "qwen3", "deepseek_v2")
_HF_ARCH_NAMES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model. ``arch`` picks the family: llama (GQA), qwen3 (GQA + q/k norm) or
    deepseek_v2 (multi-head latent attention with dense MLPs; the ``kv_lora_rank`` latent plus the
    ``qk_rope_head_dim`` rotary key is what the KV cache holds)."""

    arch: str = "llama"
    vocab_size: int = 320
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 8192
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("arch", self.arch, ARCHS)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("num_kv_heads", "head_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        check_number("rope_theta", self.rope_theta, minimum=0, exclusive_minimum=True)
        check_number("rms_norm_eps", self.rms_norm_eps, minimum=0, exclusive_minimum=True)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        parse_dtype(self.dtype)
        if self.is_mla:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                check_int(name, getattr(self, name), minimum=1)
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        else:
            check_int("num_kv_heads", self.num_kv_heads, minimum=1)
            check_int("head_dim", self.head_dim, minimum=1)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                                 f"{self.num_kv_heads}")
            if self.head_dim % 2:
                raise ValueError(f"head_dim must be even, got {self.head_dim}")

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek_v2"

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def kv_spec(self, dtype: torch.dtype | str | None = None) -> KVSpec:
        """What one token's KV looks like in the cache pools."""
        dtype = dtype or self.torch_dtype
        if self.is_mla:
            return KVSpec(self.num_layers, attention="mla", kv_lora_rank=self.kv_lora_rank,
                          rope_dim=self.qk_rope_head_dim, dtype=dtype)
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, dtype=dtype)

    def replace(self, **changes: object) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ---------------------------------------------------------------------
    def to_hf_dict(self) -> dict:
        out = {"architectures": [_HF_ARCH_NAMES[self.arch]], "model_type": self.arch,
               "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
               "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
               "num_attention_heads": self.num_heads, "rope_theta": self.rope_theta,
               "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position,
               "torch_dtype": self.dtype, "tie_word_embeddings": self.tie_word_embeddings}
        if self.is_mla:
            out.update(kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                       q_lora_rank=None, n_routed_experts=None, first_k_dense_replace=self.num_layers,
                       num_key_value_heads=self.num_heads)
        else:
            out.update(num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim)
        return out

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        arch = hf.get("model_type")
        if arch not in ARCHS:
            raise ValueError(f"model_type {arch!r} is not one of {ARCHS}")
        if arch == "deepseek_v2" and (hf.get("q_lora_rank") or hf.get("n_routed_experts")):
            raise ValueError("deepseek_v2: q_lora_rank and routed experts (MoE) are not supported")
        if hf.get("rope_scaling"):
            raise ValueError(f"rope_scaling {hf['rope_scaling']!r} is not supported (plain RoPE only)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        heads = hf["num_attention_heads"]
        fields = dict(arch=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                      intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                      num_heads=heads, rope_theta=float(hf.get("rope_theta", 10000.0)),
                      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                      max_position=hf.get("max_position_embeddings", 8192),
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      dtype=str(hf.get("torch_dtype") or "float32"))
        if arch == "deepseek_v2":
            fields.update({k: hf[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                              "v_head_dim")}, num_kv_heads=0, head_dim=0)
        else:
            fields.update(num_kv_heads=hf.get("num_key_value_heads", heads),
                          head_dim=hf.get("head_dim") or hf["hidden_size"] // heads)
        return cls(**fields)

    def save_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2))


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(arch="llama"),
    "tiny-qwen3": ModelConfig(arch="qwen3"),
    "tiny-mla": ModelConfig(arch="deepseek_v2", num_kv_heads=0, head_dim=0, kv_lora_rank=32,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    # big enough that prefill dominates the step overhead on a CPU, for the engine benchmark
    "small-llama": ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=768,
                               num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32),
    # where recomputing a page costs more than reading it from a local file store (the crossover table)
    "medium-llama": ModelConfig(arch="llama", vocab_size=512, hidden_size=1024, intermediate_size=2816,
                                num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64),
    # for a GPU: ~0.7 B parameters, recomputing a token costs ~10x reading its 32 KiB of KV back from L2
    "large-llama": ModelConfig(arch="llama", vocab_size=512, hidden_size=2048, intermediate_size=5632,
                               num_layers=16, num_heads=16, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
}


def resolve_config(name_or_path: str) -> ModelConfig:
    """A preset name, a config.json file, or a checkpoint directory holding one."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {name_or_path!r} is neither a preset {sorted(PRESETS)} nor a config path")
    return ModelConfig.from_hf_dict(json.loads(path.read_text()))
