"""The helper-thread checksums of tierkv.storage.overlap: same headers, same verdicts, every page once."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tierkv.hashing import HashNamespace, page_hashes
from tierkv.storage.overlap import Headers, Verifier, helper_pool, pages_per_group, run_ranges
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


def _ranges(num_ranges: int) -> list[tuple[int, int]]:
    return [(3 * i, 3 * i + 3) for i in range(num_ranges)]


def test_run_ranges_does_each_range_once_in_order_on_the_caller_and_a_helper():
    """Both threads take ranges (each one's first range waits until the other has taken one), every
    range runs once, and the results come back in range order."""
    pool = helper_pool()
    both = threading.Barrier(2, timeout=60.0)  # a liveness bound, not a timing
    seen = []

    def work(thread: int, start: int, end: int) -> tuple[int, int]:
        if thread not in {t for t, _ in seen}:
            seen.append((thread, start))
            both.wait()
        else:
            seen.append((thread, start))
        return start, end
    try:
        assert run_ranges(work, _ranges(9), lambda: pool, 2) == _ranges(9)
    finally:
        pool.shutdown()
    assert sorted(start for _, start in seen) == [start for start, _ in _ranges(9)]
    assert {thread for thread, _ in seen} == {0, 1}


def test_run_ranges_does_not_wait_for_a_busy_helper():
    """With every helper thread taken by other work, the caller does all ranges and returns; the helper
    job it queued is cancelled, never run later against the finished batch."""
    pool = ThreadPoolExecutor(1)
    release = threading.Event()
    blocker = pool.submit(release.wait, 60.0)
    threads = []
    try:
        assert run_ranges(lambda t, s, e: threads.append(t) or s, _ranges(4), lambda: pool, 2) == [0, 3, 6, 9]
    finally:
        release.set()
        blocker.result()
        pool.shutdown()
    assert threads == [0, 0, 0, 0]


@pytest.mark.parametrize("failing_thread", [0, 1])
def test_run_ranges_raises_a_jobs_error_after_every_range_in_flight_ended(failing_thread):
    pool = helper_pool()
    running = []
    both = threading.Barrier(2, timeout=60.0)

    def work(thread: int, start: int, end: int) -> int:
        running.append(start)
        if start < 6:
            both.wait()  # the first two ranges run at once, one per thread
        if thread == failing_thread and start < 6:
            running.remove(start)
            raise RuntimeError(f"range {start} failed")
        running.remove(start)
        return start
    try:
        with pytest.raises(RuntimeError, match="failed"):
            run_ranges(work, _ranges(2), lambda: pool, 2)
        assert running == []
    finally:
        pool.shutdown()
