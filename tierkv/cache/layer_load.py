"""Deferred, batched, layer-wise L2 -> L1 loads: HiCache's load-back path.

``init_load_back(defer=True)`` reserves device slots and queues the copy instead of starting it.
``start_loading()`` starts every queued copy as one batch that moves layer by layer, and returns a
:class:`LayerLoads`: the forward pass calls ``wait_layer(i)`` before layer ``i`` reads KV, so layer
``i``'s attention waits for layer ``i`` of the loads in flight and no more, while later layers copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.copy.transfer import CopyHandle, TransferController


@dataclass
class LayerLoads:
    """The loads a forward pass must see: every load started and not yet known complete."""

    handles: list[CopyHandle] = field(default_factory=list)

    def wait_layer(self, layer: int) -> None:
        """Order what follows after layer ``layer`` of every load (a stream wait on CUDA)."""
        for handle in self.handles:
            handle.wait_layer(layer)


class DeferredLoads:
    """Queued loads of one cache (each a PendingLoad plus its host slots) and the handles in flight."""

    def __init__(self, transfer: TransferController) -> None:
        self.transfer = transfer
        self.queued: list[tuple[Any, torch.Tensor]] = []
        self.in_flight: list[CopyHandle] = []

    def queue(self, pending: Any, host_slots: torch.Tensor) -> None:
        self.queued.append((pending, host_slots))

    def touches(self, device_slots: torch.Tensor) -> bool:
        """Whether a queued load writes any of ``device_slots``."""
        return any(torch.isin(device_slots, pending.device_slots).any() for pending, _ in self.queued)

    def start(self) -> LayerLoads:
        """Start the queued loads as one layer-wise copy; every load still in flight, for the forward."""
        if self.queued:
            pendings = [pending for pending, _ in self.queued]
            host_slots = torch.cat([slots for _, slots in self.queued])
            device_slots = torch.cat([pending.device_slots for pending in pendings])
            handle = self.transfer.load_layers(host_slots, device_slots, pendings)
            for pending in pendings:
                pending.handle = handle
            self.queued.clear()
            self.in_flight.append(handle)
        self.in_flight = [h for h in self.in_flight if not h.done()]
        return LayerLoads(list(self.in_flight))
