"""A time-to-first-token model: prefill FLOPs of the uncached tokens against KV transfer time per tier.

For a prompt of ``L`` tokens whose first ``p`` tokens are cached, the prefill computes ``n = L - p``
tokens attending to ``p + i`` earlier tokens each. FLOPs (multiply-add = 2):

- linear layers: ``2 * n * P`` with ``P`` the matmul weights per token (attention projections and MLP,
  all layers, plus the LM head once for the last token);
- attention scores and values: ``4 * layers * heads * head_dim * sum_{i<n} (p + i + 1)``.

Compute time is FLOPs / ``effective_flops`` (peak x model FLOP utilisation). Each tier below L1 adds
``latency_s + bytes / bandwidth`` for the tokens it supplies: L2 hits cross host->device; L3 hits cross
storage->host, then host->device. Transfers are not overlapped with compute and queueing is ignored, so
the model is per request in isolation: it compares tier configurations, it does not predict a server.

Defaults (documented, override with flags):
- GPU ``h100``: 989 TFLOP/s dense bf16 peak (NVIDIA H100 SXM datasheet) at 50 % utilisation.
- L2 -> L1: PCIe 5.0 x16 pinned host-to-device copy, 40 GB/s effective (64 GB/s link), 10 us per batch.
- L3 -> L2: one local NVMe SSD, 6 GB/s sequential read, 100 us per batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape for the FLOP count and the KV size (bf16 unless ``dtype_bytes`` says otherwise)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                           "vocab_size", "dtype_bytes"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def linear_weights_per_layer(self) -> int:
        h, kv_dim = self.hidden_size, self.num_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv_dim + 3 * h * self.intermediate_size  # q, o, k, v, gated MLP

    def prefill_flops(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        """FLOPs to prefill ``num_new_tokens`` after ``num_cached_tokens`` of cached context."""
        n, p = num_new_tokens, num_cached_tokens
        if n <= 0:
            return 0.0
        linear = 2.0 * n * self.num_layers * self.linear_weights_per_layer + 2.0 * self.hidden_size * self.vocab_size
        attended = n * p + n * (n + 1) / 2
        return linear + 4.0 * self.num_layers * self.hidden_size * attended


MODELS: dict[str, ModelConfig] = {m.name: m for m in (
    ModelConfig("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    ModelConfig("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
    ModelConfig("mistral-7b", 32, 4096, 32, 8, 14336, 32768),
    ModelConfig("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
    ModelConfig("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064),
)}

GPU_PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "l40s": 362e12}


def get_model(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(MODELS))}") from None


@dataclass(frozen=True)
class Link:
    """One tier-to-tier path: a fixed latency per batch plus bytes over bandwidth."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")

    def seconds(self, size_bytes: float) -> float:
        return self.latency_s + size_bytes / self.bandwidth_bytes_per_s if size_bytes > 0 else 0.0


@dataclass(frozen=True)
class TTFTModel:
    """Estimated TTFT of one request from its prompt length and hit tokens per tier."""

    model: ModelConfig
    effective_flops: float = GPU_PEAK_FLOPS["h100"] * 0.5
    kv_bytes_per_token: int | None = None
    l2_link: Link = Link(40e9, 10e-6)
    l3_link: Link = Link(6e9, 100e-6)

    def __post_init__(self) -> None:
        if not self.effective_flops > 0:
            raise ValueError(f"effective_flops must be > 0, got {self.effective_flops!r}")
        if self.kv_bytes_per_token is not None and (
                not isinstance(self.kv_bytes_per_token, int) or self.kv_bytes_per_token < 1):
            raise ValueError(f"kv_bytes_per_token must be a positive int, got {self.kv_bytes_per_token!r}")

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token or self.model.kv_bytes_per_token

    def ttft_s(self, prompt_tokens: int, l1_hit: int = 0, l2_hit: int = 0, l3_hit: int = 0) -> float:
        """Seconds to the first token: prefill of the misses plus moving the L2 and L3 hits to L1."""
        cached = l1_hit + l2_hit + l3_hit
        if cached > prompt_tokens:
            raise ValueError(f"hit tokens {cached} exceed prompt_tokens {prompt_tokens}")
        # a fully cached prompt still recomputes its last token to get the first output's logits
        new = max(prompt_tokens - cached, 1)
        compute = self.model.prefill_flops(new, prompt_tokens - new) / self.effective_flops
        b = self.bytes_per_token
        return compute + self.l2_link.seconds((l2_hit + l3_hit) * b) + self.l3_link.seconds(l3_hit * b)
