"""SlotAllocator.free_each(whole_pages=True) through the compiled free_whole_pages (tierkv/_radix_pages.c):
the same pages freed as the numpy reference, no page freed twice, anything it refuses left unchanged."""

import random

import numpy as np
import pytest
import torch

from tierkv.pools import allocator as allocator_module
from tierkv.pools.allocator import SlotAllocator

native = allocator_module._free_whole_pages
needs_native = pytest.mark.skipif(native is None, reason="tierkv._radix not built")


def _node_values(alloc: SlotAllocator, rng: random.Random, num_requests: int) -> list[torch.Tensor]:
    """What a tree's nodes hold: whole-page slices of the slot runs the allocator handed out."""
    values = []
    for _ in range(num_requests):
        slots = alloc.alloc(rng.randrange(1, 9) * alloc.page_size)
        cut = rng.randrange(0, len(slots) // alloc.page_size + 1) * alloc.page_size
        values += [part for part in (slots[:cut], slots[cut:]) if len(part)]
    rng.shuffle(values)
    return values


def _twins(page_size: int, seed: int) -> tuple[SlotAllocator, SlotAllocator, list[torch.Tensor]]:
    a, b = SlotAllocator(4096 * page_size, page_size), SlotAllocator(4096 * page_size, page_size)
    values = _node_values(a, random.Random(seed), 200)
    _node_values(b, random.Random(seed), 200)
    return a, b, values


@needs_native
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_values", [1, 2, 7, 300])  # below and above the reference's first-slot threshold
def test_frees_the_pages_the_reference_frees(monkeypatch, page_size, num_values):
    a, b, values = _twins(page_size, seed=page_size + num_values)
    a.free_each(values[:num_values], whole_pages=True)
    monkeypatch.setattr(allocator_module, "_free_whole_pages", None)
    b.free_each(values[:num_values], whole_pages=True)
    assert np.array_equal(a._is_free, b._is_free)
    assert a.num_free_slots == b.num_free_slots
    assert sorted(np.concatenate(a._released).tolist()) == sorted(np.concatenate(b._released).tolist())
    again = a.alloc(a.num_free_slots)  # what was freed is handed out again, each page once
    assert len(torch.unique(again)) == len(again)


@needs_native
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_page_given_twice_is_refused_and_never_freed_twice(page_size):
    alloc = SlotAllocator(64 * page_size, page_size)
    slots = alloc.alloc(8 * page_size)
    before = alloc._is_free.copy()
    pages = [slots[i * page_size:(i + 1) * page_size] for i in range(8)]
    for batch in (pages + [pages[3]], [slots, pages[7]]):  # the same node twice; a node inside another
        with pytest.raises(ValueError, match="twice|double"):
            native(batch, page_size, alloc._is_free, torch.int64)
        assert np.array_equal(alloc._is_free, before)
    batch = pages + [pages[3]]
    with pytest.raises(ValueError, match="double free"):
        alloc.free_each(batch, whole_pages=True)
    _assert_each_page_free_once(alloc)


def _assert_each_page_free_once(alloc: SlotAllocator) -> None:
    """free_each may free the tensors before the one it refuses, but never a page twice."""
    free = np.concatenate([alloc._free_pages, *alloc._released])
    assert len(np.unique(free)) == len(free) == int(alloc._is_free.sum())


@needs_native
def test_a_page_already_free_is_refused():
    alloc = SlotAllocator(64 * 16, 16)
    slots = alloc.alloc(4 * 16)
    alloc.free(slots[16:32])
    before = alloc._is_free.copy()
    with pytest.raises(ValueError, match="double free"):
        native([slots[:16], slots[16:32], slots[32:]], 16, alloc._is_free, torch.int64)
    assert np.array_equal(alloc._is_free, before)
    with pytest.raises(ValueError, match="double free"):
        alloc.free_each([slots[:16], slots[16:32], slots[32:]], whole_pages=True)
    _assert_each_page_free_once(alloc)


@needs_native
def test_partial_and_misaligned_pages_are_refused():
    alloc = SlotAllocator(64 * 16, 16)
    slots = alloc.alloc(4 * 16)
    before = alloc._is_free.copy()
    for bad in ([slots[:16], slots[16:24]], [slots[8:24]], [slots[:16].flip(0)]):
        with pytest.raises(ValueError):
            native(bad, 16, alloc._is_free, torch.int64)
        assert np.array_equal(alloc._is_free, before)
        twin = SlotAllocator(64 * 16, 16)
        twin.alloc(4 * 16)
        with pytest.raises(ValueError, match="whole"):
            twin.free_each(bad, whole_pages=True)


@needs_native
def test_what_it_cannot_read_goes_through_the_reference():
    """A strided or int32 tensor is refused (TypeError, nothing changed) and freed by the numpy path."""
    alloc = SlotAllocator(64, 1)
    slots = alloc.alloc(16)
    for odd in (slots[::2], slots[1::2].to(torch.int32)):
        with pytest.raises(TypeError):
            native([odd], 1, alloc._is_free, torch.int64)
    alloc.free_each([slots[::2], slots[1::2].to(torch.int32)], whole_pages=True)
    assert alloc.num_free_slots == 64
