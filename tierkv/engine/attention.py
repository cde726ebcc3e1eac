"""Paged attention in plain torch: KV lives in the device pool, addressed by token slot indices.

A forward pass runs a flat batch of tokens from several sequences (prefill chunks and decode steps
mixed). Each layer writes the K/V (or the MLA latent) of the new tokens into their slots, then every
sequence attends over its own slot list: the cached prefix slots (owned by the radix tree, never
copied) followed by the slots of the tokens it computed itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SeqSlice:
    """One sequence's part of a flat batch: query rows ``[q_start, q_end)`` and its whole slot list.

    ``kv_slots[i]`` holds the KV of position ``i``; the queries are the last ``q_end - q_start``
    positions of it, so query row ``r`` sits at position ``len(kv_slots) - (q_end - q_start) + r``.
    """

    q_start: int
    q_end: int
    kv_slots: torch.Tensor

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def first_position(self) -> int:
        return len(self.kv_slots) - self.num_queries


@dataclass
class DecodeGroup:
    """The sequences that compute one token each (decode steps), attended as one padded batch:
    their query rows, slot lists padded to the longest (with each row's own first slot, so padded
    keys are real, finite KV), and which padded positions to ignore."""

    q_rows: torch.Tensor  # [B] rows of the flat batch
    slots: torch.Tensor  # [B, max_len]
    padding: torch.Tensor  # [B, max_len] bool, True past each sequence's length

    def gather(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer``'s rows at :attr:`slots`, ``[B, max_len, ...]`` (index_select moves whole rows; a 2-D
        advanced index goes element by element on a CPU)."""
        return buffer.index_select(0, self.slots.reshape(-1)).unflatten(0, self.slots.shape)


@dataclass
class ForwardBatch:
    """Flat batch: ``input_ids``/``positions``/``out_slots`` per new token, ``seqs`` per sequence that
    computes several tokens (prefill chunks), ``decode`` for those computing one, and the rows
    (``sample_rows``) whose logits the caller wants (each sequence's last token when it samples)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    seqs: list[SeqSlice]
    decode: DecodeGroup | None
    sample_rows: torch.Tensor
    layer_loads: Any = None  # tierkv.cache.layer_load.LayerLoads: L2 -> L1 loads the layers must wait for
    _rope: dict = field(default_factory=dict, repr=False)

    def wait_kv(self, layer: int) -> None:
        """Before layer ``layer`` reads the pool: wait for that layer of the loads in flight, no more."""
        if self.layer_loads is not None:
            self.layer_loads.wait_layer(layer)

    def rope_table(self, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of the rotary angles of every token, ``[T, 1, dim]``: made once per pass, not
        once per layer."""
        key = (dim, theta)
        if key not in self._rope:
            device = self.positions.device
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
            freqs = self.positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
            self._rope[key] = (emb.cos(), emb.sin())
        return self._rope[key]

    @classmethod
    def build(cls, token_ids: list[int], seqs: list[tuple[torch.Tensor, int]], sample: list[bool],
              device: torch.device) -> "ForwardBatch":
        """From the new tokens and ``(kv_slots, num_new_tokens)`` per sequence (the new tokens are the
        slot list's tail). Every index is assembled on the host and moved in one copy: no per-sequence
        transfer, and no wait on the device (pinned memory, asynchronous on CUDA)."""
        lengths = [len(kv) for kv, _ in seqs]
        news = [n for _, n in seqs]
        starts = torch.tensor([0, *news], dtype=torch.int64).cumsum(0)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(news, dtype=torch.int64))
        first = torch.tensor(lengths, dtype=torch.int64) - torch.tensor(news, dtype=torch.int64)
        positions = first[seq_of_token] + torch.arange(len(token_ids)) - starts[seq_of_token]
        out_slots = torch.cat([kv[len(kv) - n:] for kv, n in seqs]).to(torch.int64)
        sample_rows = (starts[1:] - 1)[torch.tensor(sample, dtype=torch.bool)]
        decoding = [i for i, n in enumerate(news) if n == 1]
        prefilling = [i for i, n in enumerate(news) if n != 1]
        parts = [torch.tensor(token_ids, dtype=torch.int64), positions, out_slots, sample_rows]
        parts += [seqs[i][0].to(torch.int64) for i in prefilling]
        if decoding:
            parts += [starts[decoding], torch.tensor([lengths[i] for i in decoding], dtype=torch.int64),
                      _padded_slots([seqs[i][0] for i in decoding])]
        host = torch.cat([p.reshape(-1) for p in parts])
        if device.type == "cuda":
            host = host.pin_memory()
        packed = iter(host.to(device, non_blocking=True).split([p.numel() for p in parts]))
        input_ids, positions, out_slots, sample_rows = (next(packed) for _ in range(4))
        slices = []
        for i in prefilling:
            slices.append(SeqSlice(int(starts[i]), int(starts[i + 1]), next(packed)))
        decode = None
        if decoding:
            q_rows, bound, slots = next(packed), next(packed), next(packed).view(len(decoding), -1)
            padding = torch.arange(slots.shape[1], device=device)[None, :] >= bound[:, None]
            decode = DecodeGroup(q_rows, slots, padding)
        return cls(input_ids, positions, out_slots, slices, decode, sample_rows)


def _padded_slots(slot_lists: list[torch.Tensor]) -> torch.Tensor:
    """``[B, max_len]`` slot lists, each padded with its own first slot."""
    padded = torch.nn.utils.rnn.pad_sequence([s.to(torch.int64) for s in slot_lists], batch_first=True,
                                             padding_value=-1)
    return torch.where(padded < 0, padded[:, :1], padded)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int,
                     scale: float) -> torch.Tensor:
    """Attention of queries ``q [n, H, D]`` at positions ``first_position..`` over keys ``k [L, H, D]``
    and values ``v [L, H, Dv]`` at positions ``0..L-1``; returns ``[n, H, Dv]``."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    n, length = q.shape[0], k.shape[0]
    q_pos = torch.arange(first_position, first_position + n, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def gqa_paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buffer: torch.Tensor,
                        v_buffer: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Store the new tokens' K/V in their slots, then attend each sequence over its slot list.

    ``q [T, H, D]``, ``k_new``/``v_new [T, Hkv, D]``, buffers ``[slots, Hkv, D]``; returns ``[T, H, D]``.
    """
    k_buffer[batch.out_slots] = k_new.to(k_buffer.dtype)
    v_buffer[batch.out_slots] = v_new.to(v_buffer.dtype)
    group = q.shape[1] // k_new.shape[1]
    out = torch.empty_like(q)
    for seq in batch.seqs:
        k = k_buffer[seq.kv_slots].to(q.dtype).repeat_interleave(group, dim=1)
        v = v_buffer[seq.kv_slots].to(q.dtype).repeat_interleave(group, dim=1)
        out[seq.q_start:seq.q_end] = causal_attention(q[seq.q_start:seq.q_end], k, v, seq.first_position, scale)
    if batch.decode is not None:
        d = batch.decode
        out[d.q_rows] = decode_attention(q[d.q_rows], d.gather(k_buffer).to(q.dtype), d.gather(v_buffer).to(q.dtype),
                                         d.padding, scale)
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """One query per sequence, all sequences at once: ``q [B, H, D]`` over keys ``k [B, L, Hkv, D]`` and
    values ``v [B, L, Hkv, Dv]`` (query head ``h`` reads KV head ``h // (H // Hkv)``), ignoring
    ``padding [B, L]``; returns ``[B, H, Dv]``. The query is each sequence's last position: no causal mask."""
    num_seqs, num_heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.float().view(num_seqs, kv_heads, num_heads // kv_heads, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v.float())
    return out.reshape(num_seqs, num_heads, v.shape[-1]).to(q.dtype)
