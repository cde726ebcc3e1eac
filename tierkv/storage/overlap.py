"""Checksums off the I/O thread: headers computed and pages verified in helper threads while the
calling thread moves the bytes (pages of at least ``MIN_OVERLAP_PAGE_NBYTES``; smaller ones in place).

xxh3, HMAC-SHA256 and numpy copies release the GIL, and so do file, socket and Mooncake transfers, so
with a spare core a batch costs about its I/O time, not I/O plus one hashing pass per page. Work goes
to the helpers in groups of about ``GROUP_NBYTES`` (one hand-off per group, not per page: a hand-off
costs more than hashing a small page).

With the native checksums (:mod:`tierkv.storage.native`), :func:`checked_group` costs one GIL-free
xxh3 call and one vectorised header compare per range instead of Python work per page. Helpers hide
the hash only when a core is idle: it is a pass over memory either way, and on a busy 2-core machine
the hand-offs and a cold read on another core cost more than they hide.

:func:`run_ranges` splits a batch into ranges that the caller and a helper each take in turn, moving and
checking a whole range on one thread: for a backend that copies on a thread of its own (Mooncake's
transfer engine) two ranges are then in flight and its copies never wait for a hash. (A caller moving
every range while a helper checks the one before overlapped nothing there: 0.60 of raw for 8 MiB gets,
as in place, against 0.90 with ranges taken in turn, side by side on an idle 2-core machine; with the
other core busy all three are ~0.62.)

A batch never returns before its helper jobs have finished with its pages (the caller owns them).
Each store owns its helper threads (``pool``: made on first use, shut down when the store closes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar

import numpy as np

from tierkv.storage.page_format import (
    CHECKSUM_OFFSET,
    HEADER_SIZE,
    Digest,
    PageFormat,
    PageFormatError,
    copy_with_checksum,
)

# Large enough that a hand-off (~20 us) is noise, small enough that the first and last groups (not
# overlapped) are a small part of a batch.
GROUP_NBYTES = 2 << 20
# Smaller pages are hashed in place, on the I/O thread: their per-page Python work would hold the GIL
# against that thread, and on a loaded 2-core machine it cost more than it hid (bench_storage, 128 KiB:
# redis 0.79-0.89 overlapped against 0.94-0.98 in place; 8 MiB: 0.88-0.89 against 0.80-0.81).
MIN_OVERLAP_PAGE_NBYTES = 1 << 20
# One reader and one writer thread per store may run at once: two helpers serve both without waiting.
NUM_HELPERS = 2


def helper_pool() -> ThreadPoolExecutor:
    """Helper threads for one store (it owns them and shuts them down on close)."""
    return ThreadPoolExecutor(NUM_HELPERS, thread_name_prefix="tierkv-checksum")


def pages_per_group(page_nbytes: int) -> int:
    return max(1, GROUP_NBYTES // page_nbytes)


def _headers(fmt: PageFormat, keys: list[str], views: list[memoryview]) -> list[bytes]:
    return [fmt.header(key, view) for key, view in zip(keys, views)]


T = TypeVar("T")


class _Jobs:
    """Helper jobs that read the caller's pages: leaving the context cancels those not started and
    waits for the others, so a batch never returns while a helper still reads its pages."""

    def __init__(self) -> None:
        self._futures: list[Future] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            if not future.cancelled():
                future.exception()


class Headers(_Jobs):
    """The headers of a batch of pages to write, computed ahead in a helper thread, group by group.

    Use as a context manager: leaving it cancels the groups not yet started (a failed batch).
    """

    def __init__(self, fmt: PageFormat, keys: list[str], views: list[memoryview],
                 pool: Callable[[], ThreadPoolExecutor]) -> None:
        super().__init__()
        self._fmt, self._keys, self._views = fmt, keys, views
        self._per_group = pages_per_group(fmt.payload_nbytes)
        # one group (nothing to overlap it with) or small pages: each header when asked, no hand-off,
        # the page still in cache when it is sent
        if len(keys) > self._per_group and fmt.payload_nbytes >= MIN_OVERLAP_PAGE_NBYTES:
            helpers = pool()
            self._futures = [helpers.submit(_headers, fmt, keys[start:start + self._per_group],
                                            views[start:start + self._per_group])
                             for start in range(0, len(keys), self._per_group)]

    def get(self, index: int) -> bytes:
        """Page ``index``'s header (waits for its group)."""
        if not self._futures:
            return self._fmt.header(self._keys[index], self._views[index])
        group, offset = divmod(index, self._per_group)
        return self._futures[group].result()[offset]


class DigestHeaders:
    """The unkeyed headers of a batch whose payload digests were made where the pages were written (the
    L1 -> L2 copy; see ``PageStore.accepts_digests``): filled from them at once, nothing hashed; a page
    given None for a digest is hashed when its header is asked for. :class:`Headers`' ``get``."""

    def __init__(self, fmt: PageFormat, keys: list[str], views: list[memoryview],
                 digests: Sequence[int | None]) -> None:
        self._fmt, self._keys, self._views, self._digests = fmt, keys, views, digests
        self._rows = fmt.filled_headers(keys, [0 if d is None else d for d in digests])

    def get(self, index: int) -> bytes:
        """Page ``index``'s header."""
        if self._digests[index] is None:
            return self._fmt.header(self._keys[index], self._views[index])
        return self._rows[index].tobytes()


@dataclass
class PageCheck:
    index: int
    key: str
    header: bytes | bytearray | memoryview
    payload: memoryview
    target: memoryview | None  # copy the payload here (checksummed while in cache) before verifying


def verify_group(fmt: PageFormat, checks: list[PageCheck]) -> list[tuple[int, PageFormatError]]:
    """(index, error) of each page in ``checks`` that fails verification (each target filled first)."""
    failures = []
    for check in checks:
        state = None
        if check.target is not None and len(check.payload) == len(check.target):
            state = copy_with_checksum(check.target, check.payload, fmt.payload_hasher(check.key))
        try:
            fmt.verify(check.key, check.header, check.payload, state)
        except PageFormatError as err:
            failures.append((check.index, err))
    return failures


class Verifier(_Jobs):
    """Verifies the pages of a batch as they arrive, in a helper thread, while the next ones are read.

    :meth:`add` each page read (with its header); :meth:`failures` waits and names the pages that
    failed. With ``target`` the helper first copies the payload there (the redis reply into the page).
    """

    def __init__(self, fmt: PageFormat, pool: Callable[[], ThreadPoolExecutor]) -> None:
        super().__init__()
        self._fmt, self._pool = fmt, pool
        self._per_group = pages_per_group(fmt.payload_nbytes)
        self._in_place = fmt.payload_nbytes < MIN_OVERLAP_PAGE_NBYTES
        self._pending: list[PageCheck] = []
        self._failures: list[tuple[int, PageFormatError]] = []  # of pages checked in place

    @property
    def overlapped(self) -> bool:
        """Whether pages go to the helpers (else each is checked in place as it is added)."""
        return not self._in_place

    def add(self, index: int, key: str, header: bytes | bytearray | memoryview, payload: memoryview,
            target: memoryview | None = None) -> None:
        check = PageCheck(index, key, header, payload, target)
        if self._in_place:  # now, while the page is in cache
            self._failures += verify_group(self._fmt, [check])
            return
        self._pending.append(check)
        if len(self._pending) >= self._per_group:
            self._submit()

    def _submit(self) -> None:
        if self._pending:
            self._futures.append(self._pool().submit(verify_group, self._fmt, self._pending))
            self._pending = []

    def failures(self) -> list[tuple[int, PageFormatError]]:
        """(index, error) of every page added that failed verification, once all are checked."""
        if not self._futures:  # a batch of one group: checked here, nothing left to overlap it with
            self._failures += verify_group(self._fmt, self._pending)
            self._pending = []
            return self._failures
        self._submit()
        return self._failures + [failure for future in self._futures for failure in future.result()]


def checked_group(pageio: ModuleType, fmt: PageFormat, indexes: list[int], keys: list[str], headers: np.ndarray,
                  payloads: list[memoryview]) -> list[tuple[int, PageFormatError]]:
    """(index from ``indexes``, error) of each unkeyed page whose stored header (a row of ``headers``)
    does not match its payload: one native xxh3 call and one vectorised compare."""
    digests = pageio.xxh3_many(payloads)
    return [(indexes[i], err) for i, err in fmt.check_headers(keys, headers, payloads, digests)]


_UINT64_MASK = (1 << 64) - 1  # the native results carry digests as signed 64-bit values


def copied_group(pageio: ModuleType, fmt: PageFormat, sources: list | np.ndarray, keys: list[str],
                 payloads: list[memoryview]) -> list[tuple[int, PageFormatError]]:
    """Copy each unkeyed blob (payload then header; ``sources``: buffers, or an int64 array of addresses of
    memory this process maps) into its payload in one native pass, each chunk hashed as it lands, and
    return (index, error) of those whose header does not match."""
    headers = np.empty((len(keys), HEADER_SIZE), dtype=np.uint8)
    results = pageio.copy_blobs_xxh3(sources, payloads, headers, fmt.header_templates(keys), fmt.payload_nbytes,
                                     CHECKSUM_OFFSET)
    failures = []
    for i, (status, digest) in enumerate(results):
        if status != 0:
            try:  # names the field that differs
                fmt.verify(keys[i], headers[i].tobytes(), payloads[i], Digest(digest & _UINT64_MASK))
                failures.append((i, PageFormatError(f"page {keys[i]}: header differs from its expected bytes")))
            except PageFormatError as err:
                failures.append((i, err))
    return failures


def run_ranges(work: Callable[[int, int, int], T], ranges: list[tuple[int, int]],
               pool: Callable[[], ThreadPoolExecutor], num_threads: int) -> list[T]:
    """``work(thread, start, end)`` for each range, in ranges taken one at a time by the calling thread
    (``thread`` 0) and up to ``num_threads - 1`` helper jobs (1...); the results in range order.

    A helper that has not started when the caller runs out of ranges is cancelled (the caller did its
    share), one that has is waited for, so no range is in flight when this returns; a job's exception
    is raised here."""
    results: list = [None] * len(ranges)
    taken = itertools.count()  # its next() is one C call: atomic under the GIL

    def drain(thread: int) -> None:
        while (index := next(taken)) < len(ranges):
            results[index] = work(thread, *ranges[index])
    with _Jobs() as jobs:
        if len(ranges) > 1 and num_threads > 1:
            helpers = pool()
            jobs._futures = [helpers.submit(drain, thread) for thread in range(1, min(num_threads, len(ranges)))]
        drain(0)
    for future in jobs._futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()
    return results
