"""Model families in plain torch, parameter names as in HF checkpoints (``model.layers.0.self_attn...``).

- llama: grouped-query attention, RoPE, SwiGLU MLP.
- qwen3: llama plus RMSNorm over each head of q and k before RoPE.
- deepseek_v2: multi-head latent attention. The cache holds the normalised ``kv_lora_rank`` latent and
  the rotary key (shared by all heads) per token; K/V heads are re-expanded from the latent at
  attention time (the non-absorbed form: exact, and simple).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tierkv.engine.attention import ForwardBatch, causal_attention, decode_attention, gqa_paged_attention
from tierkv.engine.config import ModelConfig
from tierkv.pools.kv import DeviceKVPool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, batch: ForwardBatch, theta: float, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``x [T, heads, d]`` at the batch's positions (its cos/sin table is made once
    per pass). ``interleaved`` (DeepSeek's checkpoint layout) first gathers even then odd channels, as
    its reference code does."""
    d = x.shape[-1]
    cos, sin = batch.rope_table(d, theta)
    if interleaved:
        x = x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).reshape(x.shape)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.arch == "qwen3":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        cfg = self.cfg
        q = self.q_proj(x).unflatten(-1, (cfg.num_heads, cfg.head_dim))
        k = self.k_proj(x).unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x).unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        if cfg.arch == "qwen3":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, batch, cfg.rope_theta)
        k = apply_rope(k, batch, cfg.rope_theta)
        batch.wait_kv(self.layer)
        out = gqa_paged_attention(q, k, v, pool.k_buffer(self.layer), pool.v_buffer(self.layer), batch,
                                  1.0 / math.sqrt(cfg.head_dim))
        return self.o_proj(out.flatten(-2))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(qk_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        cfg = self.cfg
        q = self.q_proj(x).unflatten(-1, (cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q = torch.cat((q_nope, apply_rope(q_pe, batch, cfg.rope_theta, interleaved=True)), dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_pe = apply_rope(k_pe[:, None, :], batch, cfg.rope_theta, interleaved=True)
        batch.wait_kv(self.layer)
        cache = pool.latent_buffer(self.layer)  # [slots, 1, kv_lora_rank + rope]
        cache[batch.out_slots] = torch.cat((self.kv_a_layernorm(latent)[:, None, :], k_pe), -1).to(cache.dtype)
        out = q.new_empty(q.shape[0], cfg.num_heads, cfg.v_head_dim)
        for seq in batch.seqs:
            k, v = self._expand(cache[seq.kv_slots, 0].to(x.dtype))
            out[seq.q_start:seq.q_end] = causal_attention(q[seq.q_start:seq.q_end], k, v, seq.first_position,
                                                          self.scale)
        if batch.decode is not None:
            d = batch.decode
            k, v = self._expand(d.gather(cache)[:, :, 0].to(x.dtype))
            out[d.q_rows] = decode_attention(q[d.q_rows], k, v, d.padding, self.scale)
        return self.o_proj(out.flatten(-2))

    def _expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head K ``[..., H, nope+rope]`` and V ``[..., H, v]`` from cached latents ``[..., rank+rope]``."""
        cfg = self.cfg
        latent, k_pe = cached.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).unflatten(-1, (cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim))
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], cfg.num_heads, -1)), dim=-1)
        return k, v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer) if cfg.is_mla else GQAAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only LM whose attention reads and writes KV through a :class:`DeviceKVPool`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        """Run the flat batch; returns fp32 logits of ``batch.sample_rows`` as ``[rows, vocab]``."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, batch, pool)
        x = self.model.norm(x[batch.sample_rows])
        return self.lm_head(x).float()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def init_random_(model: CausalLM, seed: int) -> None:
    """Seeded weights, drawn on the CPU so every device gets the same model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            elif "embed_tokens" in name:
                values = torch.randn(param.shape, generator=gen)
            else:
                values = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1])
            param.copy_(values.to(param.dtype))
