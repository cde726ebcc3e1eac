"""What one token's KV looks like: attention kind, layers, heads, dims and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_KINDS = ("mha", "mla")


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "torch.float16"); ValueError names a bad one."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
    else:
        resolved = None
    if not isinstance(resolved, torch.dtype) or resolved.is_complex or resolved == torch.bool:
        raise ValueError(f"dtype {dtype!r} is not a real torch dtype (e.g. float16, bfloat16, float32)")
    return resolved


@dataclass(frozen=True)
class KVSpec:
    """Per-token KV shape. MHA/GQA: K and V of [kv_heads, head_dim] per layer; MLA: one latent per layer.

    Every pool stores tokens as ``[num_kv, num_layers, slots, heads, dim]`` logically, where
    ``num_kv`` is 2 for MHA (K, V) and 1 for MLA, and ``heads`` is 1 for MLA.
    """

    num_layers: int
    kv_heads: int = 0
    head_dim: int = 0
    attention: str = "mha"
    kv_lora_rank: int = 0
    rope_dim: int = 0
    dtype: torch.dtype | str = torch.float16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION_KINDS}")
        _positive("num_layers", self.num_layers)
        if self.attention == "mha":
            _positive("kv_heads", self.kv_heads)
            _positive("head_dim", self.head_dim)
        else:
            _positive("kv_lora_rank", self.kv_lora_rank)
            if not isinstance(self.rope_dim, int) or self.rope_dim < 0:
                raise ValueError(f"rope_dim must be an int >= 0, got {self.rope_dim!r}")

    @property
    def num_kv(self) -> int:
        return 2 if self.attention == "mha" else 1

    @property
    def heads(self) -> int:
        return self.kv_heads if self.attention == "mha" else 1

    @property
    def dim(self) -> int:
        return self.head_dim if self.attention == "mha" else self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv * self.num_layers * self.heads * self.dim * self.dtype.itemsize

    def shard(self, tp_rank: int, tp_size: int) -> "KVSpec":
        """The slice of heads one tensor-parallel rank holds (MLA latents are replicated, not split)."""
        if self.attention == "mla" or tp_size == 1:
            return self
        if self.kv_heads % tp_size:
            raise ValueError(f"kv_heads {self.kv_heads} not divisible by tp_size {tp_size}")
        return KVSpec(self.num_layers, self.kv_heads // tp_size, self.head_dim, dtype=self.dtype)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
