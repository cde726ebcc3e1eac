"""The slot arithmetic of the cache's match and insert: gathering a matched prefix's device slots, and which of
an insert's slots the tree takes, duplicates or must not pin.

Why numpy and C rather than torch: a match and an insert each handle a handful of small slot arrays, where a
torch op (a slice, ``cat``, ``clone``, ``numpy()``) costs 1.5-10 us and numpy's or a compiled loop's a few
hundred ns; the insert converts the caller's tensor once and slices the array. The compiled helpers
(``gather_device_slots``, ``plan_slots`` in tierkv/_radix_slots.c) read nodes' tensors in place; the
numpy versions below are their reference (tests set the natives to None).
"""

from __future__ import annotations

import numpy as np
import torch

from tierkv.pools.allocator import SLICE_SLACK_BYTES, SLICE_SLACK_SHIFT, SlotAllocator, slack_bytes
from tierkv.radix import InsertPlan, TreeNode
from tierkv.radix_key import load_native
from tierkv.radix_walk import Walk

native_gather = load_native("gather_device_slots")
native_plan_slots = load_native("plan_slots")
_EMPTY = torch.empty(0, dtype=torch.int64)


def device_prefix(nodes: list[TreeNode]) -> tuple[int, torch.Tensor, int]:
    """How many leading ``nodes`` hold device slots, those slots in order (a new tensor), and their count."""
    if native_gather is not None:
        count, raw = native_gather(nodes, torch.int64)
        return (count, torch.frombuffer(raw, dtype=torch.int64), len(raw) // 8) if raw else (count, _EMPTY, 0)
    count = 0
    for node in nodes:
        if node.device_value is None:
            break
        count += 1
    slots = torch.cat([n.device_value for n in nodes[:count]]) if count else _EMPTY
    return count, slots, slots.shape[0]


def slot_array(device_slots: torch.Tensor) -> np.ndarray:
    """``device_slots`` as a contiguous int64 array, sharing its memory when it can."""
    try:
        slots = device_slots.numpy()
    except (RuntimeError, TypeError):  # on a device, or requires grad
        slots = device_slots.detach().cpu().numpy()
    return slots if slots.flags.c_contiguous else np.ascontiguousarray(slots)


def plan_slots(plan: InsertPlan, device_slots: torch.Tensor, allocator: SlotAllocator
               ) -> tuple[np.ndarray | None, list[tuple[int, int]], torch.Tensor | None]:
    """For an insert of ``device_slots`` as ``plan`` says: the caller's slots unequal to those of the nodes on
    the path that hold device slots (copies of KV the tree holds, to be freed; None when there are none), the
    ranges of the slots that valueless nodes on the path take, and the new leaf's value when it is a copy
    made here (None: the caller slices it, see :func:`unpinned`). Raises ValueError, changing nothing, unless
    the slots the insert takes (those ranges, the new leaf's and the unequal ones) are allocated in
    ``allocator``, whole pages, each given once, none of them a page the path's nodes keep."""
    walk = plan.walk
    if native_plan_slots is not None:
        leaf = _leaf_copy(plan, device_slots.shape[0])
        try:
            try:  # the tensor read in place: no numpy view of it (a tenth of a short insert)
                mismatched, revived = _native_plan(device_slots, plan, allocator, leaf)
            except TypeError:  # not readable in place (on a device, not contiguous): its array
                mismatched, revived = _native_plan(slot_array(device_slots), plan, allocator, leaf)
        except ValueError:
            pass  # the reference names the problem
        else:
            return ((None if mismatched is None else np.frombuffer(mismatched, dtype=np.int64)), revived or [],
                    None if leaf is None else torch.from_numpy(leaf))
    slots = slot_array(device_slots)
    freed, revived, kept = _plan_slots(walk, slots)
    taken = [slots[start:end] for start, end in revived] + [slots[walk.end:plan.num_elems]]
    if freed is not None:
        taken.append(freed)
    allocator.check_taken(taken, "device_slots")
    ps = allocator.page_size
    clash = np.intersect1d(np.concatenate(taken) // ps, kept // ps) if kept is not None else ()
    if len(clash):
        raise ValueError(f"device_slots: page {int(clash[0])} is the tree's own: it may not be taken or freed again")
    return freed, revived, None


def _native_plan(slots: torch.Tensor | np.ndarray, plan: InsertPlan, allocator: SlotAllocator,
                 leaf: np.ndarray | None) -> tuple:
    walk = plan.walk
    return native_plan_slots(slots, walk.nodes, walk.partial, walk.partial_len, plan.num_elems, allocator.page_size,
                             allocator.page_flags, torch.int64, leaf)


def _leaf_copy(plan: InsertPlan, num_slots: int) -> np.ndarray | None:
    """An empty array for the new leaf's slots when a view of the caller's ``num_slots`` would keep more than
    :func:`slack_bytes` alive (the compiled check fills it); None when a view may stay, or there is no leaf.
    Why numpy: a tensor over a numpy array is the cheapest to make (numpy caches small blocks) and small to
    keep (36 B per token cached on the fan-out shape; a tensor of its own storage took 33 but cost a fan-out
    insert a fifth more, one over a bytearray 42)."""
    own = plan.num_elems - plan.walk.num_matched - plan.walk.partial_len
    if not own or (num_slots - own) * 8 <= max(SLICE_SLACK_BYTES, own * 8 >> SLICE_SLACK_SHIFT):
        return None
    return np.empty(own, dtype=np.int64)


def _plan_slots(walk: Walk, slots: np.ndarray) -> tuple[np.ndarray | None, list[tuple[int, int]], np.ndarray | None]:
    """The numpy reference of ``plan_slots`` of tierkv/_radix_slots.c, and the path's own slots (None if none)."""
    nodes = walk.nodes if walk.partial is None else [*walk.nodes, walk.partial]
    mine, held, revived, pos = [], [], [], 0
    for node in nodes:
        end = min(pos + len(node.key), walk.end)
        if node.device_value is None:
            revived.append((pos, end))
        else:
            mine.append(slots[pos:end])
            held.append(node.device_value.numpy()[:end - pos])
        pos = end
    if not mine:
        return None, revived, None
    mine, held = np.concatenate(mine), np.concatenate(held)
    unequal = mine[mine != held]
    return (unequal if len(unequal) else None), revived, held


def leaf_view(device_slots: torch.Tensor, plan: InsertPlan) -> torch.Tensor | None:
    """The new leaf's slots as a slice of the caller's tensor, for an insert whose new leaf alone takes slots
    (no node revived, none split) and for which :func:`plan_slots` made no copy (the tensor is within
    :func:`slack_bytes` of the leaf's part): when the tensor is a contiguous CPU one whose storage holds no
    more than that either. None: the caller slices it through :func:`unpinned`. Why: a numpy view, the
    pinning check and a tensor over the slice cost a trace insert 2.4 us; this ~1."""
    start = plan.walk.num_matched
    own = (plan.num_elems - start) * 8
    if (not own or not device_slots.is_cpu or not device_slots.is_contiguous()
            or device_slots.untyped_storage().nbytes() - own > max(SLICE_SLACK_BYTES, own >> SLICE_SLACK_SHIFT)):
        return None
    return device_slots[start:plan.num_elems]


def unpinned(device_slots: torch.Tensor, slots: np.ndarray, plan: InsertPlan,
             revived: list[tuple[int, int]]) -> np.ndarray:
    """``slots`` (the array of ``device_slots``), or a copy of it when a node would keep a view of it (the new
    leaf, or a node ``revived``) and that view would keep alive a larger buffer under ``device_slots`` (the
    scheduler passes ``request.slots[:n]``)."""
    walk = plan.walk
    own = plan.num_elems - walk.num_matched - walk.partial_len
    for start, end in revived:
        own = max(own, end - start)
    own *= 8
    if not own or slots.nbytes - own > max(SLICE_SLACK_BYTES, own >> SLICE_SLACK_SHIFT):  # slack_bytes, inline
        return slots  # every part taken is copied anyway (see owned_array_slice)
    if device_slots.untyped_storage().nbytes() - slots.nbytes > slack_bytes(own):
        return slots.copy()
    return slots
