"""The native chunk copy (tierkv/copy/_rowcopy.c): exact bytes for any mapping, and no byte written on bad input."""

import logging
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.copy import cpu_copy
from tests.pool_helpers import random_pools
from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, KVSpec

pytestmark = pytest.mark.skipif(not cpu_copy.native_available(), reason="tierkv.copy._rowcopy is not built")

SPECS = [KVSpec(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float16),
         KVSpec(num_layers=3, attention="mla", kv_lora_rank=5, rope_dim=2, dtype=torch.bfloat16)]
# Rows as wide as a real model's (1 KiB: pages of 1-16 KiB when whole pages move as one run) and rows of an
# odd width (136 bytes), so that runs of every size class cross the pools' layouts.
WIDE_SPECS = [KVSpec(num_layers=2, kv_heads=4, head_dim=128, dtype=torch.float16),
              KVSpec(num_layers=2, kv_heads=1, head_dim=68, dtype=torch.float16)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), spec=st.sampled_from(SPECS), layout=st.sampled_from(HOST_LAYOUTS),
       page_size=st.sampled_from([1, 2, 4]), to_host=st.booleans())
def test_native_copy_equals_a_canonical_gather_scatter(data, spec, layout, page_size, to_host):
    device, host = random_pools(spec, layout, page_size)
    src, dst = (device, host) if to_host else (host, device)
    n = data.draw(st.integers(0, min(src.num_pages, dst.num_pages)))
    src_pages = torch.tensor(data.draw(st.lists(st.integers(0, src.num_pages - 1), min_size=n, max_size=n)),
                             dtype=torch.int64)  # repeats allowed on the source side
    dst_pages = torch.tensor(data.draw(st.permutations(range(dst.num_pages)))[:n], dtype=torch.int64)
    expected = dst.buffer.clone()
    if n:
        reference = dst.buffer
        dst.buffer = expected  # scatter the reference into the copy, then swap back
        dst.paged, dst.page_dim, dst.perm = dst._paged_view()
        dst.scatter_pages(dst_pages, src.gather_pages(src_pages))
        dst.buffer = reference
        dst.paged, dst.page_dim, dst.perm = dst._paged_view()
    cpu_copy.copy_page_chunks(src, src_pages, dst, dst_pages)
    assert torch.equal(dst.buffer.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("bad_page", [-1, 16, 1 << 40])
def test_a_page_outside_the_pool_is_an_error_and_nothing_is_written(bad_page):
    device, host = random_pools(SPECS[0], "page_first", 2)
    before = [pool.buffer.view(torch.uint8).clone() for pool in (device, host)]
    with pytest.raises(ValueError, match=str(bad_page) if bad_page >= 0 else "negative"):
        cpu_copy.copy_page_chunks(host, torch.tensor([0, 1]), device, torch.tensor([3, bad_page]))
    with pytest.raises(ValueError, match="page"):
        cpu_copy.copy_page_chunks(device, torch.tensor([bad_page, 0]), host, torch.tensor([0, 1]))
    assert all(torch.equal(pool.buffer.view(torch.uint8), b) for pool, b in zip((device, host), before))


def test_malformed_arguments_are_rejected_by_the_native_module():
    device, host = random_pools(SPECS[0], "layer_first", 1)
    base, inner = device.chunk_bases(True, device.row_dim_order)
    pages = np.arange(2, dtype=np.int64)
    args = [host.rows_np, device.rows_np, base, base, pages, pages, 64, 64, inner, 16]
    with pytest.raises(TypeError, match="int64"):
        cpu_copy.native.copy_pages(*args[:4], pages.astype(np.int32), *args[5:])
    with pytest.raises(ValueError, match="mismatched"):
        cpu_copy.native.copy_pages(*args[:5], pages[:1], *args[6:])
    with pytest.raises(ValueError, match="positive"):
        cpu_copy.native.copy_pages(*args[:-1], 0)
    read_only = host.rows_np.copy()
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        cpu_copy.native.copy_pages(read_only, *args[1:])


def test_page_tensors_of_other_dtypes_and_strides_are_converted():
    device, host = random_pools(SPECS[0], "page_first_direct", 2)
    expected = device.gather_pages(torch.tensor([4, 5]))
    strided = torch.tensor([[7, 0], [2, 0]])[:, 0]
    cpu_copy.copy_page_chunks(device, torch.tensor([4, 5], dtype=torch.int32), host, strided)
    assert torch.equal(host.gather_pages(torch.tensor([7, 2])).view(torch.uint8), expected.view(torch.uint8))


class _SlotsTensor(torch.Tensor):
    """A tensor subclass, read in place like any tensor."""


SLOT_FORMS = {"int64": lambda t: t, "int32": lambda t: t.int(), "strided": lambda t: torch.stack([t, t], 1)[:, 0],
              "offset_view": lambda t: torch.cat([torch.full((3,), -1), t])[3:],
              "subclass": lambda t: t.as_subclass(_SlotsTensor),
              "numpy": lambda t: t.numpy(), "numpy_strided": lambda t: np.stack([t.numpy(), t.numpy()], 1)[:, 0]}


@pytest.mark.parametrize("form", sorted(SLOT_FORMS))
def test_slot_arrays_of_any_form_copy_the_same_pages(form):
    """The slot path takes CPU int64 tensors and arrays as they are and converts the rest, as the page path."""
    device, host = random_pools(SPECS[1], "page_first", 2)
    expected = device.gather_pages(torch.tensor([4, 5]))
    src_slots, dst_slots = torch.tensor([8, 9, 10, 11]), torch.tensor([14, 15, 4, 5])
    convert = SLOT_FORMS[form]
    cpu_copy.ChunkCopy(device, host).copy_slots(convert(src_slots), convert(dst_slots))
    assert torch.equal(host.gather_pages(torch.tensor([7, 2])).view(torch.uint8), expected.view(torch.uint8))


def test_plain_int64_slot_tensors_are_read_in_place_without_a_numpy_view(monkeypatch):
    """The allocator's tensors (CPU, int64, contiguous) go to C as they are: a numpy view of each cost 0.5 us,
    a third of a small copy's call. Any other tensor still goes through its numpy view."""
    device, host = random_pools(SPECS[0], "page_first", 2)
    copy = cpu_copy.ChunkCopy(device, host)
    views = []
    plain_numpy = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy", lambda t, *a, **k: views.append(t) or plain_numpy(t, *a, **k))
    copy.copy_slots(torch.tensor([8, 9, 10, 11]), torch.tensor([14, 15, 4, 5]))
    assert views == []
    device.allocator.free(device.allocator.alloc(4))
    assert views == []
    copy.copy_slots(SLOT_FORMS["strided"](torch.tensor([8, 9, 10, 11])), torch.tensor([14, 15, 4, 5]))
    assert views  # the strided one (and, on the retry that converts both, each again)


def test_a_pool_off_the_cpu_builds_without_a_numpy_view():
    """Accelerator pools (``meta`` stands in for CUDA here) never reach the native copy."""
    pool = DeviceKVPool(SPECS[0], 32, 4, "meta")
    assert pool.rows_np is None and pool.rows.device.type == "meta"


def _reference_gather(src, src_pages, dst, dst_pages):
    """``dst`` bytes after the copy, by the same-work baseline of bench/bench_copy.py: one
    ``index_select`` of the source's token rows in the destination's memory order, written to the
    destination's rows of those pages."""
    expected = dst.rows.clone()
    src_rows = src.page_rows(src_pages).permute(dst.row_dim_order).reshape(-1)
    dst_rows = dst.page_rows(dst_pages).permute(dst.row_dim_order).reshape(-1)
    expected[dst_rows] = torch.index_select(src.rows, 0, src_rows)
    return expected


SLOT_PATTERNS = {
    "one_run": lambda g, n, pages: torch.arange(3, 3 + n),
    "runs": lambda g, n, pages: torch.cat([torch.arange(0, n // 2), torch.arange(pages - (n - n // 2), pages)]),
    "scattered": lambda g, n, pages: torch.randperm(pages, generator=g)[:n],
    "ascending_gaps": lambda g, n, pages: torch.randperm(pages, generator=g)[:n].sort().values,
}


@pytest.mark.parametrize("dst_pattern", ["one_run", "scattered"])
@pytest.mark.parametrize("src_pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("to_host", [True, False], ids=["write", "load"])
@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec", SPECS + WIDE_SPECS, ids=["mha", "mla", "mha_1k_rows", "mha_136b_rows"])
def test_slot_copy_equals_the_reference_gather(spec, layout, page_size, to_host, src_pattern, dst_pattern):
    """The small-copy fast path (slots in, one native call) moves exactly the bytes of the bench's
    baseline gather, and no other byte, for every layout, page size and run structure."""
    device, host = random_pools(spec, layout, page_size, 16, 32, seed=page_size)
    src, dst = (device, host) if to_host else (host, device)
    g = torch.Generator().manual_seed(len(src_pattern) * 7 + page_size)
    n = 10
    src_pages = SLOT_PATTERNS[src_pattern](g, n, src.num_pages)
    dst_pages = SLOT_PATTERNS[dst_pattern](g, n, dst.num_pages)
    expected = _reference_gather(src, src_pages, dst, dst_pages)
    copy = cpu_copy.ChunkCopy(src, dst)
    copy.copy_slots(src.allocator.pages_to_slots(src_pages), dst.allocator.pages_to_slots(dst_pages))
    assert torch.equal(dst.rows, expected)


def test_slot_copy_check_only_copies_nothing():
    device, host = random_pools(SPECS[0], "page_first", 4)
    before = host.rows.clone()
    cpu_copy.ChunkCopy(device, host).copy_slots(torch.arange(8), torch.arange(16, 24), check_only=True)
    assert torch.equal(host.rows, before)


BAD_SLOTS = {  # name: (page_size, destination slots given the destination pool's slot count)
    "partial_page": (4, lambda num_slots: torch.arange(6)),
    "misaligned": (4, lambda num_slots: torch.arange(1, 9)),
    "not_consecutive": (4, lambda num_slots: torch.tensor([0, 2, 3, 1, 4, 5, 6, 7])),
    "out_of_range": (4, lambda num_slots: torch.arange(num_slots, num_slots + 4)),
    "out_of_range_page_1": (1, lambda num_slots: torch.tensor([3, num_slots])),
    "negative": (4, lambda num_slots: torch.arange(-4, 0)),
    "negative_page_1": (1, lambda num_slots: torch.tensor([-1, 0])),
}


@pytest.mark.parametrize("bad", sorted(BAD_SLOTS))
def test_bad_slots_are_the_allocators_errors_and_nothing_is_written(bad):
    page_size, make = BAD_SLOTS[bad]
    device, host = random_pools(SPECS[0], "layer_first", page_size)
    host_slots = make(host.num_slots)
    before = [pool.rows.clone() for pool in (device, host)]
    with pytest.raises(ValueError) as allocator_error:
        host.allocator.slots_to_pages(host_slots)
    with pytest.raises(ValueError) as native_error:
        cpu_copy.ChunkCopy(device, host).copy_slots(torch.arange(len(host_slots)), host_slots)
    assert str(native_error.value) == str(allocator_error.value)
    assert all(torch.equal(pool.rows, b) for pool, b in zip((device, host), before))


def test_slot_counts_that_differ_are_an_error_naming_the_copy():
    device, host = random_pools(SPECS[0], "layer_first", 2)
    with pytest.raises(ValueError, match="^write: 4 source slots vs 2 destination slots$"):
        cpu_copy.ChunkCopy(device, host, name="write").copy_slots(torch.arange(4), torch.arange(2))


def test_a_native_build_of_another_api_version_is_ignored(caplog):
    """A stale _rowcopy found on the path (its functions take other arguments) leaves the torch fallback."""
    assert cpu_copy.usable_native(cpu_copy.native) is cpu_copy.native
    stale = types.ModuleType("tierkv.copy._rowcopy")  # a build from before API_VERSION existed
    with caplog.at_level(logging.WARNING, logger="tierkv.copy.cpu_copy"):
        assert cpu_copy.usable_native(stale) is None
    assert f"API version 1, expected {cpu_copy.NATIVE_API_VERSION}" in caplog.text
    assert cpu_copy.usable_native(None) is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_copies_with_a_page_first_host_walk_the_host_page_front_to_back(page_size):
    """Both directions go page by page in the page-first host pool's memory order, so the host side of each
    page is one forward pass and only the L1 side jumps (a load walked in L1's order took 2-4% longer)."""
    device, host = random_pools(SPECS[0], "page_first", page_size)
    for src, dst in ((device, host), (host, device)):
        _, _, dst_base, src_base = cpu_copy.ChunkCopy(src, dst)._buffers
        host_base = dst_base if dst is host else src_base
        row_nbytes = host.rows.shape[1]
        assert list(host_base) == list(range(0, len(host_base) * row_nbytes, row_nbytes))
