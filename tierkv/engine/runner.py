"""Model runner: turns scheduled work items into one flat forward pass over the paged KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierkv.engine.attention import ForwardBatch
from tierkv.engine.models import CausalLM
from tierkv.pools.kv import DeviceKVPool


@dataclass
class WorkItem:
    """``new_token_ids`` are the tokens at the tail of ``kv_slots`` whose KV this pass computes;
    ``sample`` asks for the logits after the last of them."""

    new_token_ids: list[int]
    kv_slots: torch.Tensor
    sample: bool


class ModelRunner:
    """Owns the model and the device pool it reads; device-agnostic (CPU or CUDA)."""

    def __init__(self, model: CausalLM, device_pool: DeviceKVPool) -> None:
        if device_pool.device != model.device:
            raise ValueError(f"device pool on {device_pool.device} but model on {model.device}")
        spec = model.config.kv_spec(device_pool.spec.dtype)
        if spec != device_pool.spec:
            raise ValueError(f"device pool spec {device_pool.spec} does not fit the model ({spec})")
        self.model = model
        self.pool = device_pool

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, items: list[WorkItem], layer_loads: Any = None) -> torch.Tensor:
        """One pass over all items; returns fp32 logits ``[num_sampling_items, vocab]`` in item order, on
        the host (its one wait for the device per pass).

        ``layer_loads`` (a :class:`tierkv.cache.layer_load.LayerLoads`): each layer waits for its own layer
        of those L2 -> L1 loads before reading KV, so the copy of later layers overlaps this compute."""
        batch = ForwardBatch.build([t for it in items for t in it.new_token_ids],
                                   [(it.kv_slots, len(it.new_token_ids)) for it in items],
                                   [it.sample for it in items], self.device)
        batch.layer_loads = layer_loads
        # on the host in one copy: the caller reads every row there (a copy per row is a wait per row)
        return self.model(batch.input_ids, batch, self.pool).cpu()
