"""The slot arithmetic of the cache's match and insert: gathering a matched prefix's device slots, and which of
an insert's slots the tree takes, duplicates or must not pin.

Why numpy and C rather than torch: a match and an insert each handle a handful of small slot arrays, where a
torch op (a slice, ``cat``, ``clone``, ``numpy()``) costs 1.5-10 us and numpy's or a compiled loop's a few
hundred ns; the insert converts the caller's tensor once and slices the array. The compiled helpers
(``gather_device_slots``, ``slot_mismatches`` in tierkv/_radix_slots.c) read nodes' tensors in place; the
numpy versions below are their reference (tests set the natives to None).
"""

from __future__ import annotations

import numpy as np
import torch

from tierkv.pools.allocator import slack_bytes
from tierkv.radix import InsertPlan, TreeNode
from tierkv.radix_key import load_native

native_gather = load_native("gather_device_slots")
native_mismatches = load_native("slot_mismatches")
_EMPTY = torch.empty(0, dtype=torch.int64)


def device_prefix(nodes: list[TreeNode]) -> tuple[int, torch.Tensor]:
    """How many leading ``nodes`` hold device slots, and those slots in order (a new tensor)."""
    if native_gather is not None:
        count, raw = native_gather(nodes, torch.int64)
        return count, torch.frombuffer(raw, dtype=torch.int64) if raw else _EMPTY
    count = 0
    for node in nodes:
        if node.device_value is None:
            break
        count += 1
    return count, torch.cat([n.device_value for n in nodes[:count]]) if count else _EMPTY


def slot_array(device_slots: torch.Tensor) -> np.ndarray:
    """``device_slots`` as a contiguous int64 array, sharing its memory when it can."""
    try:
        slots = device_slots.numpy()
    except (RuntimeError, TypeError):  # on a device, or requires grad
        slots = device_slots.detach().cpu().numpy()
    return slots if slots.flags.c_contiguous else np.ascontiguousarray(slots)


def split_plan(plan: InsertPlan, slots: np.ndarray) -> tuple[list[tuple[TreeNode, int, int]], list[np.ndarray]]:
    """The planned path's nodes holding device slots as ``(node, start, end)`` of ``slots``, and the parts of
    ``slots`` that the insert gives to nodes (valueless nodes on the path, then the new leaf)."""
    walk = plan.walk
    nodes = walk.nodes if walk.partial is None else walk.nodes + [walk.partial]
    shared, taken, pos = [], [], 0
    for node in nodes:
        end = min(pos + len(node.key), walk.end)
        if node._device_value is None:
            taken.append(slots[pos:end])
        else:
            shared.append((node, pos, end))
        pos = end
    if walk.end < plan.num_elems:
        taken.append(slots[walk.end:plan.num_elems])
    return shared, taken


def duplicates(slots: np.ndarray, shared: list[tuple[TreeNode, int, int]]) -> np.ndarray:
    """The slots of ``slots[start:end]`` unequal to ``node``'s at the same place, for each of ``shared``:
    the caller's copies of KV the tree already holds, to be freed."""
    if not shared:
        return slots[:0]
    if native_mismatches is not None:
        return np.frombuffer(native_mismatches(slots, shared, torch.int64), dtype=np.int64)
    mine = np.concatenate([slots[start:end] for _, start, end in shared])
    held = np.concatenate([node.device_value.numpy()[:end - start] for node, start, end in shared])
    return mine[mine != held]


def unpinned(device_slots: torch.Tensor, slots: np.ndarray, taken: list[np.ndarray]) -> np.ndarray:
    """``slots`` (the array of ``device_slots``), or a copy of it when a node would keep a view of it and that
    view would keep alive a larger buffer under ``device_slots`` (the scheduler passes ``request.slots[:n]``)."""
    if not taken:
        return slots
    own = max(len(t) for t in taken) * 8
    if slots.nbytes - own > slack_bytes(own):
        return slots  # every part taken is copied anyway (see owned_slot_slice)
    if device_slots.untyped_storage().nbytes() - slots.nbytes > slack_bytes(own):
        return slots.copy()
    return slots
