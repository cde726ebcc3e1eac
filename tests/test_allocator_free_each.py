"""SlotAllocator.free_each frees node by node as free() would, with or without reading every slot."""

import pytest
import torch

from tierkv.pools.allocator import SlotAllocator


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("whole_pages", [False, True])
@pytest.mark.parametrize("num_pages", [3, 600])  # 600 pages of 16: past the first-slot reading threshold
def test_free_each_frees_like_free_and_refuses_a_double_free(page_size, whole_pages, num_pages):
    alloc = SlotAllocator(1024 * page_size, page_size)
    slots = alloc.alloc(num_pages * page_size)
    parts = [slots[i * page_size:(i + 1) * page_size] for i in range(num_pages)]
    alloc.free_each(parts[1:], whole_pages=whole_pages)
    assert alloc.num_used_slots == page_size
    assert alloc.owned_mask().sum() == 1
    with pytest.raises(ValueError, match="double free"):
        alloc.free_each([parts[0], parts[1]] + parts[2:], whole_pages=whole_pages)
    # what the refused call freed (the parts before the bad one, or nothing) is free, the rest is not
    assert alloc.owned_mask().sum() in (0, 1)
    assert not alloc.owned_mask()[parts[1][0].item() // page_size]


def test_free_each_reading_first_slots_checks_the_range():
    alloc = SlotAllocator(16 * 300, 16)
    alloc.alloc(16 * 300)
    with pytest.raises(ValueError, match="out of range"):
        alloc.free_each([torch.arange(16 * 300, 16 * 600)], whole_pages=True)
