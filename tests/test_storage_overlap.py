"""The helper-thread checksums of tierkv.storage.overlap: same headers, same verdicts, every page once."""

import pytest
import torch

from tierkv.hashing import HashNamespace, page_hashes
from tierkv.storage.overlap import Headers, Verifier, helper_pool, pages_per_group, ramp
from tierkv.storage.page_format import PageFormat

PAGE_NBYTES = 3000


@pytest.fixture(autouse=True, params=[True, False], ids=["helper-threads", "in-place"])
def overlapped(request, monkeypatch):
    from tierkv.storage import overlap
    monkeypatch.setattr(overlap, "MIN_OVERLAP_PAGE_NBYTES", 0 if request.param else 1 << 40)


def _pages(num_pages: int) -> tuple[list[str], list[memoryview]]:
    keys = page_hashes(list(range(num_pages)), 1, None, HashNamespace(model="m"))
    g = torch.Generator().manual_seed(1)
    pages = [torch.randint(0, 256, (PAGE_NBYTES,), dtype=torch.uint8, generator=g) for _ in keys]
    return keys, [memoryview(p.numpy()) for p in pages]


@pytest.mark.parametrize("num_pages,page_nbytes", [(0, 4096), (1, 8 << 20), (3, 3000), (16, 8 << 20),
                                                   (1024, 128 << 10), (5000, 4096)])
def test_ramp_covers_every_page_once_in_order_with_small_ends(num_pages, page_nbytes):
    bounds = ramp(num_pages, page_nbytes, 4 << 20, 64 << 20, 512)
    assert [p for start, end in bounds for p in range(start, end)] == list(range(num_pages))
    sizes = [end - start for start, end in bounds]
    assert all(0 < s <= 512 for s in sizes)
    if len(sizes) > 2:  # the first and last calls overlap nothing: sizes grow from and shrink to them
        assert sizes[0] <= sizes[1] and sizes[-1] <= sizes[-2]


@pytest.mark.parametrize("page_key", [None, "k" * 32])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_headers_from_the_helpers_are_the_formats_own(page_key, num_groups):
    fmt = PageFormat("ns", PAGE_NBYTES, page_key)
    keys, views = _pages((num_groups - 1) * pages_per_group(PAGE_NBYTES) + 5)
    pool = helper_pool()
    with Headers(fmt, keys, views, lambda: pool) as headers:
        got = [headers.get(i) for i in range(len(keys))]
    pool.shutdown()
    assert got == [fmt.header(k, v) for k, v in zip(keys, views)]


@pytest.mark.parametrize("with_target", [False, True])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_verifier_names_exactly_the_bad_pages_and_lands_the_good_ones(with_target, num_groups):
    fmt = PageFormat("ns", PAGE_NBYTES)
    keys, views = _pages((num_groups - 1) * pages_per_group(PAGE_NBYTES) + 9)
    blobs = [bytearray(v) + fmt.header(k, v) for k, v in zip(keys, views)]
    bad = {0, 7, len(keys) - 1}
    for i in bad:
        blobs[i][i % PAGE_NBYTES] ^= 1
    targets = [torch.zeros(PAGE_NBYTES, dtype=torch.uint8) for _ in keys]
    pool = helper_pool()
    verifier = Verifier(fmt, lambda: pool)
    for i, (key, blob) in enumerate(zip(keys, blobs)):
        header, payload = fmt.split(memoryview(blob))
        verifier.add(i, key, header, payload, target=memoryview(targets[i].numpy()) if with_target else None)
    assert sorted(i for i, _ in verifier.failures()) == sorted(bad)
    pool.shutdown()
    if with_target:
        good = [i for i in range(len(keys)) if i not in bad]
        assert all(bytes(targets[i].numpy()) == bytes(views[i]) for i in good)
