"""Paged attention in plain torch: KV lives in the device pool, addressed by token slot indices.

A forward pass runs a flat batch of tokens from several sequences (prefill chunks and decode steps
mixed). Each layer writes the K/V (or the MLA latent) of the new tokens into their slots, then every
sequence attends over its own slot list: the cached prefix slots (owned by the radix tree, never
copied) followed by the slots of the tokens it computed itself.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class ForwardBatch:
    """Flat batch: ``positions``/``out_slots`` per new token, ``seqs`` per sequence, and the rows
    (``sample_rows``) whose logits the caller wants (each sequence's last token when it samples)."""

    positions: torch.Tensor
    out_slots: torch.Tensor
    seqs: list[SeqSlice]
    sample_rows: torch.Tensor
    layer_loads: Any = None  # tierkv.layer_load.LayerLoads: L2 -> L1 loads the layers must wait for

    def wait_kv(self, layer: int) -> None:
        """Before layer ``layer`` reads the pool: wait for that layer of the loads in flight, no more."""
        if self.layer_loads is not None:
            self.layer_loads.wait_layer(layer)

    @classmethod
    def build(cls, seqs: list[tuple[torch.Tensor, int]], sample: list[bool], device: torch.device) -> "ForwardBatch":
        """From ``(kv_slots, num_new_tokens)`` per sequence; the new tokens are the slot list's tail."""
        positions, out_slots, slices, rows = [], [], [], []
        start = 0
        for (kv_slots, num_new), wants_logits in zip(seqs, sample):
            first = len(kv_slots) - num_new
            positions.append(torch.arange(first, len(kv_slots), dtype=torch.int64))
            out_slots.append(kv_slots[first:])
            slot_list = kv_slots.to(device)
            slices.append(SeqSlice(start, start + num_new, slot_list))
            start += num_new
            if wants_logits:
                rows.append(start - 1)
        return cls(torch.cat(positions).to(device), torch.cat(out_slots).to(device), slices,
                   torch.tensor(rows, dtype=torch.int64, device=device))


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
    return out
