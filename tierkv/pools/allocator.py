"""Page-granular slot allocator: a free list of pages, handing out token slot indices."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

try:
    from tierkv.copy import _rowcopy
except ImportError:  # no compiler at install time: the numpy checks below do it all
    _rowcopy = None
# The native checks of free and check_allocated (tierkv/copy/_rowcopy_alloc.c): one pass each, where numpy's
# take a dozen ops and a sort. None: the numpy reference alone (a build without them; tests set it). Their
# arguments are those of API 4; API 5 added the hashed copy only.
native = _rowcopy if getattr(_rowcopy, "API_VERSION", 0) in (4, 5) else None
_NATIVE_REFUSED = (ValueError, TypeError, BufferError, RuntimeError)
# torch's dispatch guard that skips autograd's view tracking (what inference mode uses inside); None
# where a torch build lacks it
_BELOW_VIEW_TRACKING = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)


def _native_free_whole_pages():
    """``tierkv._radix.free_whole_pages``, or None: not built, an older build, or the pure-Python tree asked."""
    if os.environ.get("TIERKV_PURE_PYTHON_TREE") == "1":
        return None
    try:
        from tierkv import _radix
    except ImportError:
        return None
    return getattr(_radix, "free_whole_pages", None)


# free_each's compiled pass over whole-page tensors (tierkv/_radix_pages.c), None when not built (tests set it)
_free_whole_pages = _native_free_whole_pages()
_INT64 = np.dtype(np.int64)


def plain_slot_slices() -> contextlib.AbstractContextManager:
    """A context in which slicing a slot tensor makes a plain alias of its storage, not an autograd view.

    Slot tensors are int64 indices, never differentiated, so the record autograd keeps for a view (its
    base, how to replay it) serves nothing; without it a slice costs about half as much to make and to
    free. A tree holds one slice per node and frees one per node it evicts, so the cache inserts and
    splits under this. Plain slicing where torch lacks the guard.
    """
    return _BELOW_VIEW_TRACKING() if _BELOW_VIEW_TRACKING is not None else contextlib.nullcontext()


# bytes beyond its own that a node's slot slice may keep alive: a partial last page of up to 64 slots, or
# an eighth of its own (a long prompt's new part is most of its slot tensor: copying 100k slots to save the
# few hundred of its prefix cost 4 ms)
SLICE_SLACK_BYTES = 64 * 8
SLICE_SLACK_SHIFT = 3  # an eighth: own >> 3
# free_each(whole_pages=True) reads first slots only from this many slots (or 8 tensors) on: below, numpy's
# per-call cost is more than the native check of every slot
_READ_FIRSTS_MIN_SLOTS = 4096


def owned_slot_slice(slots: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``slots[start:end]`` as a tree node keeps it: a view when the buffer under it holds at most
    :func:`slack_bytes` more, else a copy. Why: a view keeps its whole buffer alive, and a short branch's
    slice of a request's slots pinned the slots of the whole shared prompt (100 branches of 50 tokens under
    a 3,000-token prompt held 61x the bytes they needed). SGLang's tree copies every value. ``slots`` may be
    the numpy array of a caller's tensor (see :func:`owned_array_slice`)."""
    if type(slots) is np.ndarray:
        return owned_array_slice(slots, start, end)
    part = slots[start:end]
    own = part.nbytes
    if part.untyped_storage().nbytes() - own > slack_bytes(own):
        return part.clone()
    return part


def owned_array_slice(slots: np.ndarray, start: int, end: int) -> torch.Tensor:
    """:func:`owned_slot_slice` of an int64 array: a tensor over ``slots[start:end]``, or over a copy when
    ``slots`` is more than :func:`slack_bytes` larger. The array must not itself pin a larger buffer (the
    cache copies it first when it would). Why numpy: a copy and a tensor over it cost a quarter of a
    ``clone()`` of a torch slice."""
    part = slots[start:end]
    own = part.nbytes
    if slots.nbytes - own > max(SLICE_SLACK_BYTES, own >> SLICE_SLACK_SHIFT):  # slack_bytes, inline: per insert
        part = part.copy()
    return torch.from_numpy(part)


def slack_bytes(own_nbytes: int) -> int:
    """Bytes beyond ``own_nbytes`` that a kept slice may keep alive (see :data:`SLICE_SLACK_BYTES`)."""
    return max(SLICE_SLACK_BYTES, own_nbytes >> SLICE_SLACK_SHIFT)


class SlotAllocator:
    """Owns ``num_pages`` pages of ``page_size`` slots. Slots are int64 CPU tensors.

    Freed pages are parked and merged (sorted) into the free list only when it runs short, so
    allocations stay mostly contiguous, which lets copies run as few large blocks.

    The bookkeeping is numpy, not torch: requests allocate and free a few pages at a time, where
    torch's per-op dispatch cost several times what numpy's does on the same tiny arrays. The checks of
    :meth:`free` and :meth:`check_allocated` run natively when built (:data:`native`); whatever the native
    check refuses goes through the numpy reference, which names the problem (or accepts a form C does not
    take), so both give the same results and errors.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(num_slots, int) or num_slots < page_size:
            raise ValueError(f"num_slots must be an int >= page_size ({page_size}), got {num_slots!r}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        self._positions: np.ndarray | None = None  # scratch for check_allocated
        self._ramp = np.arange(0, dtype=np.int64)  # 0, 1, 2, ...: grown on demand, for _is_run
        self.reset()

    def reset(self, keep: torch.Tensor | None = None) -> None:
        """Free every page but those of the slots ``keep`` (held by an owner that outlives the reset)."""
        self._is_free = np.ones(self.num_pages, dtype=np.bool_)
        if keep is not None and keep.numel():
            self._is_free[self._slots_to_pages(keep)] = False
        self._free_pages = np.flatnonzero(self._is_free).astype(np.int64)
        self._released: list[np.ndarray] = []
        self._num_released = 0

    @property
    def num_free_slots(self) -> int:
        return (len(self._free_pages) + self._num_released) * self.page_size

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - self.num_free_slots

    def check_num_tokens(self, num_tokens: int) -> None:
        """Raise unless ``num_tokens`` is an int >= 0 and a multiple of page_size."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"num_tokens must be an int, got {num_tokens!r}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens % self.page_size:
            raise ValueError(f"num_tokens {num_tokens} is not a multiple of page_size {self.page_size}")

    def check_allocated(self, slots: torch.Tensor, name: str) -> None:
        """Raise ValueError unless ``slots`` (1-D int64) are whole aligned pages in range, allocated,
        each given once. Vectorised numpy: inserts call it on every prompt's slots."""
        if self._checked_natively(slots):
            return
        slots_np = slots.detach().cpu().numpy()
        if len(slots_np) == 0:
            return
        if self.page_size == 1:
            pages = slots_np
        else:
            try:
                pages = self._slots_to_pages(slots)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if pages.min() < 0 or pages.max() >= self.num_pages:
            raise ValueError(f"{name}: slot out of range [0, {self.num_slots})")
        free = self._is_free[pages]
        if free.any():
            raise ValueError(f"{name}: pages {pages[free].tolist()[:8]} are not allocated")
        # each page given once: write each position into a scratch array; a repeated page keeps
        # only its last position (O(n), no sort)
        if self._positions is None:
            self._positions = np.zeros(self.num_pages, dtype=np.int64)
        order = np.arange(len(pages))
        self._positions[pages] = order
        if not (self._positions[pages] == order).all():
            raise ValueError(f"{name}: pages {_duplicates(pages).tolist()[:8]} given more than once")

    @property
    def page_flags(self) -> np.ndarray:
        """Per page: True when free. The allocator's own array, for native checks that restore what they flip."""
        return self._is_free

    def check_taken(self, parts: list[np.ndarray], name: str) -> None:
        """:meth:`check_allocated` of int64 arrays (the slots an insert gives to nodes), as one set."""
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else None
        if slots is not None and len(slots) and not self._checked_natively(slots):
            self.check_allocated(torch.from_numpy(slots), name)

    def _checked_natively(self, slots: torch.Tensor | np.ndarray) -> bool:
        """True when the native check of :meth:`check_allocated` passed; False when there is none or it
        refused the slots (the numpy reference then names the problem)."""
        if native is None:
            return False
        try:
            native.check_allocated(slots, self.page_size, self._is_free)
        except _NATIVE_REFUSED:
            return False
        return True

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` (a multiple of page_size), or None when not enough are free."""
        self.check_num_tokens(num_tokens)
        num_pages = num_tokens // self.page_size
        if num_pages > len(self._free_pages):
            self._merge_released()
            if num_pages > len(self._free_pages):
                return None
        pages, self._free_pages = self._free_pages[:num_pages], self._free_pages[num_pages:]
        self._is_free[pages] = False
        return torch.from_numpy(self._pages_to_slots(pages))

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages of slots; freeing a slot that is already free is an error."""
        if slots.numel() == 0:
            return
        if native is not None and slots.numel() % self.page_size == 0:
            pages = np.empty(slots.numel() // self.page_size, dtype=np.int64)
            try:
                native.free_slots(slots, self.page_size, self._is_free, pages)
            except _NATIVE_REFUSED:
                pass  # nothing changed: the reference names the problem
            else:
                self._released.append(pages)
                self._num_released += len(pages)
                return
        pages = self._slots_to_pages(slots, every_slot=False)
        was_free = self._is_free[pages]
        if was_free.any() or (len(pages) > 1 and not _all_distinct(pages)):
            bad = pages[was_free] if was_free.any() else _duplicates(pages)
            raise ValueError(f"double free of pages {bad.tolist()[:8]}")
        self._is_free[pages] = True
        self._released.append(pages)
        self._num_released += len(pages)

    def free_each(self, slot_tensors: list[torch.Tensor], whole_pages: bool = False) -> None:
        """:meth:`free` of each tensor, as one release: an eviction frees one tensor per node. Why not
        ``free(torch.cat(...))``: the concatenation wrote a fresh copy of every slot evicted (a whole-tree
        eviction spent most of its time faulting that copy's pages in); here each tensor's pages are
        checked and written straight into one array of released pages. A tensor refused is an error
        raised after the ones before it were freed.

        ``whole_pages``: the caller vouches that each tensor is whole aligned pages it owns (a tree node's
        slots, checked when they were inserted and never changed since), so only each page's first slot
        is read, not every slot; freeing a page twice is still an error. Why: on page 16, reading every
        evicted slot was most of an eviction's time."""
        if whole_pages and _free_whole_pages is not None and self._free_whole_pages(slot_tensors):
            return
        if whole_pages and len(slot_tensors) > 1 and (
                len(slot_tensors) >= 8 or sum(map(len, slot_tensors)) >= _READ_FIRSTS_MIN_SLOTS):
            self._free_pages_of(slot_tensors)
            return
        if native is None or len(slot_tensors) < 2:
            for slots in slot_tensors:
                self.free(slots)
            return
        ps = self.page_size
        counts = [t.numel() // ps for t in slot_tensors]
        pages = np.empty(sum(counts), dtype=np.int64)
        start = 0
        for i, (slots, count) in enumerate(zip(slot_tensors, counts)):
            try:
                if slots.numel() % ps:
                    raise ValueError(f"{slots.numel()} slots are not whole pages of {ps}")
                native.free_slots(slots, ps, self._is_free, pages[start:start + count])
            except _NATIVE_REFUSED:  # the reference names the problem, or frees a form C does not take
                self._release(pages[:start])
                self.free(slots)
                self.free_each(slot_tensors[i + 1:])
                return
            start += count
        self._release(pages)

    def _free_whole_pages(self, slot_tensors: list[torch.Tensor]) -> bool:
        """:meth:`free_each` of whole-page tensors in one compiled pass (tierkv/_radix_pages.c): no numpy view
        and no ``len`` per tensor, the two costliest steps of a steady eviction. False, nothing freed, when
        it refuses them (not CPU contiguous int64 tensors, a bad or twice-freed page): the callers' paths then
        free them or name the problem."""
        try:
            pages = _free_whole_pages(slot_tensors, self.page_size, self._is_free, torch.int64)
        except _NATIVE_REFUSED:
            return False
        self._release(np.frombuffer(pages, _INT64))  # a dtype object: its lookup by name was half the call
        return True

    def _free_pages_of(self, slot_tensors: list[torch.Tensor]) -> None:
        """:meth:`free_each` of whole-page tensors, reading each page's first slot only."""
        ps = self.page_size
        firsts = np.concatenate([t.numpy()[::ps] for t in slot_tensors])
        pages = firsts // ps if ps > 1 else firsts
        if len(pages) and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"slot out of range [0, {self.num_slots})")
        was_free = self._is_free[pages]
        if was_free.any() or (len(pages) > 1 and not _all_distinct(pages)):
            bad = pages[was_free] if was_free.any() else _duplicates(pages)
            raise ValueError(f"double free of pages {bad.tolist()[:8]}")
        self._is_free[pages] = True
        self._release(pages)

    def _release(self, pages: np.ndarray) -> None:
        if len(pages):
            self._released.append(pages)
            self._num_released += len(pages)

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._pages_to_slots(np.asarray(pages.numpy(), dtype=np.int64)))

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Page ids of whole-page slot runs; a partial or misaligned page is an error (each page's first
        and last slot checked: the slots of copies are whole pages of allocated or inserted slots)."""
        return torch.from_numpy(self._slots_to_pages(slots, every_slot=False))

    def owned_mask(self) -> torch.Tensor:
        """Per page: True when allocated. For integrity checks."""
        return torch.from_numpy(~self._is_free)

    def _pages_to_slots(self, pages: np.ndarray) -> np.ndarray:
        if native is not None and pages.flags.c_contiguous:
            slots = np.empty(len(pages) * self.page_size, dtype=np.int64)
            native.pages_to_slots(pages, self.page_size, slots)
            return slots
        if self.page_size == 1:
            return pages.copy()
        if len(pages) > 1 and self._is_run(pages):  # the usual allocation: one stretch of free pages
            first = int(pages[0]) * self.page_size
            return np.arange(first, first + len(pages) * self.page_size, dtype=np.int64)
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _slots_to_pages(self, slots: torch.Tensor, every_slot: bool = True) -> np.ndarray:
        """A fresh int64 array of the page ids; raises ValueError unless ``slots`` are whole aligned pages.

        Every copy, free and insert validates its slots here, so the usual case (one run of consecutive
        slots, as the allocator hands them out) is checked with one compare against a cached ramp.
        ``every_slot=False`` checks only each page's first and last slot (O(pages), not O(slots)): for
        slots that are whole-page slices of what :meth:`alloc` returned or :meth:`check_allocated` passed,
        which is all that frees and copies see; a wrong length or a misaligned page is still an error.
        """
        if slots.device.type != "cpu" or slots.requires_grad:
            slots = slots.detach().cpu()
        slots = np.asarray(slots.numpy().reshape(-1), dtype=np.int64)
        ps = self.page_size
        if len(slots) % ps:
            raise ValueError(f"{len(slots)} slots are not whole pages of {ps}")
        if ps == 1:
            pages = slots.copy()
        elif len(slots) and slots[0] % ps == 0 and self._is_run(slots):
            first = int(slots[0]) // ps
            pages = np.arange(first, first + len(slots) // ps, dtype=np.int64)
        else:
            grid = slots.reshape(-1, ps)
            pages = grid[:, 0] // ps
            if every_slot:
                whole = np.array_equal(grid, pages[:, None] * ps + self._page_offsets)
            else:
                first, last = grid[:, 0], grid[:, -1]
                whole = not (first % ps).any() and bool((last - first == ps - 1).all())
            if not whole:
                raise ValueError("slots are not whole aligned pages")
        if len(pages) and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise ValueError(f"slot out of range [0, {self.num_slots})")
        return pages

    def _is_run(self, values: np.ndarray) -> bool:
        """True when ``values`` (int64, non-empty) are consecutive ascending integers."""
        n = len(values)
        if int(values[-1]) - int(values[0]) != n - 1:
            return False
        if len(self._ramp) < n:
            self._ramp = np.arange(max(n, 2 * len(self._ramp)), dtype=np.int64)
        return bool((values - values[0] == self._ramp[:n]).all())

    def _merge_released(self) -> None:
        if self._released:
            merged = np.concatenate([self._free_pages, *self._released])
            merged.sort()
            self._free_pages = merged
            self._released, self._num_released = [], 0

    def check_ownership(self, tier: str, owned: list[torch.Tensor]) -> None:
        """Raise AssertionError unless every allocated slot is in exactly one of ``owned`` (whole
        aligned pages, in range) and no free slot is in any. For integrity checks."""
        slots = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        if slots.dtype != torch.int64:
            raise AssertionError(f"{tier} slots of dtype {slots.dtype}, expected int64")
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise AssertionError(f"{tier} slots outside [0, {self.num_slots})")
        if self.page_size > 1:  # every owner holds whole aligned pages, so pages are freed whole
            if any(len(v) % self.page_size for v in owned):
                raise AssertionError(f"{tier} slots owned in partial pages")
            rows = slots.view(-1, self.page_size)
            aligned = rows[:, :1] - rows[:, :1] % self.page_size + torch.arange(self.page_size)
            if not torch.equal(rows, aligned):
                raise AssertionError(f"{tier} slots not in whole aligned pages")
        counts = torch.bincount(slots, minlength=self.num_slots) if len(slots) else torch.zeros(
            self.num_slots, dtype=torch.int64)
        if (counts > 1).any():
            raise AssertionError(f"{tier} slots owned twice: {torch.nonzero(counts > 1).flatten()[:8].tolist()}")
        allocated = self.owned_mask().repeat_interleave(self.page_size)
        owned_mask = counts > 0
        if not torch.equal(allocated, owned_mask):
            leaked = torch.nonzero(allocated & ~owned_mask).flatten()[:8].tolist()
            stray = torch.nonzero(owned_mask & ~allocated).flatten()[:8].tolist()
            raise AssertionError(f"{tier} pool: leaked slots {leaked}, owned but free {stray}")


def _all_distinct(pages: np.ndarray) -> bool:
    ordered = np.sort(pages)
    return not (ordered[1:] == ordered[:-1]).any()


def _duplicates(pages: np.ndarray) -> np.ndarray:
    values, counts = np.unique(pages, return_counts=True)
    return values[counts > 1]
