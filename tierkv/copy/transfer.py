"""L1 <-> L2 copies, asynchronous: CUDA streams and events on a GPU, one worker thread on CPU. On CPU a
load, a small write, or a queued copy that a caller waits for before the worker has started it runs on the
caller's thread instead: a hand-off costs more than such copies take.

Completed copies are acknowledged through FIFO queues the cache polls without blocking. Completion is
reported as "the leading N operations are done" so that tensor-parallel ranks can agree on one number.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tierkv.copy import cpu_copy, device_copy
from tierkv.pools.kv import (DeviceKVPool, HostKVPool, PagedKVBuffer, paired_page_rows,
                             rows_adjacent_per_page)

log = logging.getLogger(__name__)

IO_BACKENDS = ("kernel", "direct")


def resolve_host_layout(layout: str, io_backend: str) -> str:
    """The seed's rule: the direct backend copies per page, so plain page_first becomes page_first_direct."""
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"io_backend {io_backend!r} is not one of {IO_BACKENDS}")
    if io_backend == "direct" and layout == "page_first":
        log.warning("io_backend 'direct' with layout 'page_first': using 'page_first_direct' instead")
        return "page_first_direct"
    return layout


def page_runs(src_pages: Sequence[int] | torch.Tensor, dst_pages: Sequence[int] | torch.Tensor
              ) -> list[tuple[int, int, int]]:
    """Split a page mapping into (src_start, dst_start, count) runs contiguous on both sides."""
    src, dst = _int64_array(src_pages), _int64_array(dst_pages)
    if len(src) == 0:
        return []
    # vectorised (numpy: per-op cost matters, mappings are often a few pages): a Python loop over
    # pages cost more than the copies themselves for small KV
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(starts, append=len(src))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), counts.tolist()))


def _int64_array(pages: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().cpu().numpy()
    return np.asarray(pages, dtype=np.int64).reshape(-1)


def copy_pages(src: PagedKVBuffer, src_pages: torch.Tensor, dst: PagedKVBuffer, dst_pages: torch.Tensor,
               io_backend: str) -> None:
    """Copy whole pages between two pools of any layouts.

    ``kernel``: between CPU pools, one native chunk copy per batch when the extension is built (see
    :mod:`tierkv.copy.cpu_copy`); between an accelerator and the host, a device-side gather or scatter and
    a DMA per contiguous host stretch (:mod:`tierkv.copy.device_copy`); otherwise runs of consecutive pages
    as single strided copies when there are few runs, and token rows with vectorised index copies when
    there are many. ``direct`` copies page by page.
    """
    kernel = device_copy.select_device_copy(src, dst, io_backend)
    if kernel is not None:  # one Triton launch for the batch
        kernel(src, src_pages, dst, dst_pages)
        return
    non_blocking = src.device.type == "cuda" or dst.device.type == "cuda"
    if io_backend == "direct":
        for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
            dst.page_range(d, 1).copy_(src.page_range(s, 1), non_blocking=non_blocking)
        return
    on_cpu = src.device.type == "cpu" and dst.device.type == "cpu"
    if on_cpu and cpu_copy.native_available():
        cpu_copy.copy_page_chunks(src, src_pages, dst, dst_pages)
        return
    if src.device.type == "cpu" and dst.device.type != "cpu":
        if device_copy.staged_copy(dst, dst_pages, src, src_pages, to_host=False):
            return
    elif dst.device.type == "cpu" and src.device.type != "cpu":
        if device_copy.staged_copy(src, src_pages, dst, dst_pages, to_host=True):
            return
    runs = page_runs(src_pages, dst_pages)
    wide_rows = rows_adjacent_per_page(src, dst)
    run_nbytes = len(src_pages) * src.page_nbytes / max(len(runs), 1)
    # Per-run strided copies when runs are few, or large while rows are narrow (per-call overhead is
    # then small and no index is needed); otherwise row gathers. Cross-device copies always go by run.
    if not on_cpu or len(runs) <= 4 or (not wide_rows and run_nbytes >= _RUN_COPY_MIN_BYTES):
        for s, d, n in runs:
            dst.page_range(d, n).copy_(src.page_range(s, n), non_blocking=non_blocking)
        return
    src_table, src_rows, dst_table, dst_rows = paired_page_rows(src, src_pages, dst, dst_pages)
    cpu_copy.copy_rows(src_table, src_rows, src.row_dim_order, dst_table, dst_rows, dst.row_dim_order)


def copy_layer_rows(src_table: torch.Tensor, src_rows: torch.Tensor, src_order: tuple[int, ...],
                    dst_table: torch.Tensor, dst_rows: torch.Tensor, dst_order: tuple[int, ...], layer: int
                    ) -> None:
    """Copy layer ``layer`` of the pages whose row indices :func:`paired_page_rows` gave (CPU pools)."""
    cpu_copy.copy_rows(src_table, src_rows[:, layer:layer + 1], src_order, dst_table, dst_rows[:, layer:layer + 1],
                       dst_order)


def copy_layer(src: HostKVPool, src_pages: torch.Tensor, dst: PagedKVBuffer, dst_pages: torch.Tensor,
               layer: int) -> None:
    """Copy layer ``layer`` of whole pages host -> accelerator on the current stream (the accelerator
    path of a layer-wise load; CPU pools use :func:`copy_layer_rows`).

    The layer's token rows are gathered on the host into a staging buffer, pinned when the pool is, then
    moved in one non-blocking copy and scattered on the device. (Indexing the pinned pool directly would
    give a pageable tensor, whose copy is synchronous.) torch's pinned-memory cache does not reuse the
    staging buffer before that copy has run.
    """
    rows = src.page_rows(src_pages)[:, layer]  # [num_kv, pages, page_size] indices into src.rows
    staging = torch.empty((rows.numel(), src.rows.shape[1]), dtype=torch.uint8, pin_memory=src.buffer.is_pinned())
    torch.index_select(src.rows, 0, rows.reshape(-1), out=staging)
    spec = src.spec
    data = staging.view(spec.dtype).view(spec.num_kv, len(src_pages), src.page_size, spec.heads, spec.dim)
    dst_layer = dst.paged.permute(dst.perm).select(1, layer)  # [num_kv, pages, page_size, heads, dim]
    dst_layer.index_copy_(1, dst_pages.to(dst.device), data.to(dst.device, non_blocking=True))


def _page_mapping(kind: str, src: PagedKVBuffer, src_slots: torch.Tensor, dst: PagedKVBuffer,
                  dst_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The source and destination pages of a copy; ValueError when their counts differ."""
    src_pages, dst_pages = src.allocator.slots_to_pages(src_slots), dst.allocator.slots_to_pages(dst_slots)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{kind}: {len(src_slots)} source slots vs {len(dst_slots)} destination slots")
    return src_pages, dst_pages


def _copy_here(kind: str, run: Callable[[torch.Tensor, torch.Tensor], None], src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> BaseException | None:
    """Run a copy on this thread: None when it succeeded, else its error, logged (its KV must not be
    used). Bad slots raise ValueError (nothing was copied). An interrupt (KeyboardInterrupt, SystemExit:
    not an Exception) is returned like any failure, since the copy may have stopped half-way: the caller
    first hands the failure to whatever owns the copy's slots, then re-raises it (:func:`raise_interrupt`)."""
    try:
        run(src_slots, dst_slots)
    except ValueError:
        raise
    except BaseException as exc:
        log.error("%s copy failed: %r", kind, exc)
        return exc
    return None


def raise_interrupt(error: BaseException | None) -> None:
    """Re-raise ``error`` when it is an interrupt rather than a failed copy (not an Exception: Ctrl-C,
    ``sys.exit``), once the failed copy is settled: it must not end as a copy error."""
    if error is not None and not isinstance(error, Exception):
        raise error


# CPU writes up to this size run on the submitting thread: a hand-off to the worker (queue, event,
# GIL switches) costs 30-100 us, more than copying this many bytes. Larger ones go to the worker (the
# scheduler does not wait for writes), and run on the caller's thread after all if it waits for one
# before the worker has started it.
_INLINE_COPY_MAX_BYTES = 256 * 1024
_RUN_COPY_MIN_BYTES = 256 * 1024


# The completion event of every copy run on the submitting thread: set once, never cleared (building
# and setting an event per copy is a measurable part of a small copy).
_COPIED = threading.Event()
_COPIED.set()


@dataclass(slots=True)
class CopyHandle:
    """Completion of one batch copy. ``error`` is set when the copy failed (its KV must not be used)."""

    cuda_event: Any = None
    cpu_event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # per layer, for a layer-wise load (CUDA or CPU events); an empty tuple by default, not a list made
    # per handle (with the slots, a handle costs 0.20 us to make instead of 0.27)
    layer_events: Sequence = ()
    # a CPU copy still queued: runs it (and those queued ahead) on the waiting thread instead of waking
    # the worker; None for copies on CUDA, copies already run and layer-wise loads
    run_here: Callable[[], None] | None = field(default=None, repr=False)

    def done(self) -> bool:
        if self.cuda_event is not None:
            return self.cuda_event.query()
        return self.cpu_event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        if self.cuda_event is not None:
            self.cuda_event.synchronize()
            return True
        if self.cpu_event is _COPIED or self.cpu_event.is_set():  # a copy run inline, or done: no lock
            return True
        if timeout_s is None and self.run_here is not None:
            self.run_here()
        return self.cpu_event.wait(timeout_s)

    def wait_layer(self, layer: int) -> None:
        """Order later work after layer ``layer`` of this copy (after all of it when not layer-wise)."""
        if not self.layer_events:
            self.wait_on_current_stream()
        elif self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.layer_events[layer])
        else:
            self.layer_events[layer].wait()

    def wait_on_current_stream(self) -> None:
        """Order later work after this copy: the compute stream waits on CUDA, the caller on CPU."""
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)
        else:
            self.wait()


# The handle of every copy run on the submitting thread that succeeded: complete and never changed
# (nothing writes to a handle once its copy has finished), so one serves them all
_COPIED_HANDLE = CopyHandle(cpu_event=_COPIED)


# An ack queue's entry: (handle, payload), a plain tuple (made without a Python call; an entry is made
# and popped per copy, right after the copy has evicted the interpreter from the CPU caches)
Ack = tuple[CopyHandle, Any]


def _ack_here(acks: deque[Ack], payload: Any, error: BaseException | None) -> CopyHandle:
    """Queue the ack of a copy that ran on this thread and ended with ``error`` (None: it succeeded); an
    interrupt is re-raised once the failed ack is queued (see :meth:`TransferController._submit`)."""
    handle = _COPIED_HANDLE if error is None else CopyHandle(cpu_event=_COPIED, error=error)
    acks.append((handle, payload))
    if error is not None:
        raise_interrupt(error)
    return handle


class TransferController:
    """Runs write (L1->L2) and load (L2->L1) batches asynchronously and keeps their ack queues.

    Thread contract: submit and poll from one thread (the scheduler's); only copies run elsewhere.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, io_backend: str = "kernel",
                 overlap_writes: bool = True) -> None:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend {io_backend!r} is not one of {IO_BACKENDS}")
        self.device_pool, self.host_pool, self.io_backend = device_pool, host_pool, io_backend
        # CPU writes over _INLINE_COPY_MAX_BYTES go to the worker, overlapping the caller's next work;
        # False: they run here too (a caller that waits for each write at once gains nothing from a hand-off)
        self.overlap_writes = overlap_writes
        self.writes: deque[Ack] = deque()
        self.loads: deque[Ack] = deque()
        self.use_cuda = device_pool.device.type == "cuda"
        if self.use_cuda:
            self._write_stream = torch.cuda.Stream(device_pool.device)
            self._load_stream = torch.cuda.Stream(device_pool.device)
        else:
            self._worker = _CopyWorker()
            self._cpu_copies = {"write": _SlotCopy("write", device_pool, host_pool, io_backend),
                                "load": _SlotCopy("load", host_pool, device_pool, io_backend)}
        self.delay_hook: Callable[[str], None] | None = None  # tests inject per-rank delays here

    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor, payload: Any = None) -> CopyHandle:
        """Queue an L1 -> L2 copy of whole pages; its ack carries ``payload``. A failed copy is reported on
        the handle; an interrupt during a copy run here propagates once its ack is queued, failed."""
        return self._submit("write", self.device_pool, device_slots, self.host_pool, host_slots, self.writes, payload)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, payload: Any = None) -> CopyHandle:
        """Queue an L2 -> L1 copy of whole pages; its ack carries ``payload``. Failures as for :meth:`write`."""
        if self.use_cuda or self.delay_hook is not None or not self._worker.idle():
            return self._submit("load", self.host_pool, host_slots, self.device_pool, device_slots, self.loads,
                                payload)
        # run here at once (see _copy_inline), without _submit's steps: this is most loads, and each Python
        # step after a copy runs with the interpreter evicted from the CPU caches by the copied bytes
        return _ack_here(self.loads, payload, _copy_here("load", self._cpu_copies["load"].run_now, host_slots,
                                                         device_slots))

    def load_layers(self, host_slots: torch.Tensor, device_slots: torch.Tensor, payloads: Sequence[Any]
                    ) -> CopyHandle:
        """Queue an L2 -> L1 copy that moves one layer at a time, each layer signalled on its own (see
        :meth:`CopyHandle.wait_layer`); one ack per payload, all sharing the handle."""
        src, dst = self.host_pool, self.device_pool
        src_pages, dst_pages = _page_mapping("load", src, host_slots, dst, device_slots)
        handle, num_layers = CopyHandle(), dst.spec.num_layers
        if self.use_cuda:
            self._load_stream.wait_stream(torch.cuda.current_stream(dst.device))
            with torch.cuda.stream(self._load_stream):
                kernel = device_copy.select_device_copy(src, dst, self.io_backend)
                copy_one_layer = (kernel.layer_copier(src, src_pages, dst, dst_pages) if kernel is not None
                                  else partial(copy_layer, src, src_pages, dst, dst_pages))
                handle.layer_events = [torch.cuda.Event() for _ in range(num_layers)]
                for layer, event in enumerate(handle.layer_events):
                    copy_one_layer(layer)
                    event.record(self._load_stream)
            handle.cuda_event = handle.layer_events[-1]
        else:
            handle.layer_events = [threading.Event() for _ in range(num_layers)]
            self._worker.submit(handle, partial(self._copy_layers, handle, src_pages, dst_pages))
        self.loads.extend((handle, payload) for payload in payloads)
        return handle

    def _copy_layers(self, handle: CopyHandle, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        try:
            if self.delay_hook is not None:
                self.delay_hook("load")
            copy_one_layer = self._cpu_layer_copier(src_pages, dst_pages)
            for layer, event in enumerate(handle.layer_events):
                copy_one_layer(layer)
                event.set()
        except BaseException as exc:  # reported through the handle: the loads' KV must not be used
            log.error("layer-wise load failed: %s", exc)
            handle.error = exc
        finally:
            for event in handle.layer_events:  # waiters of later layers must not hang on a failure
                event.set()
            handle.cpu_event.set()

    def _cpu_layer_copier(self, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> Callable[[int], None]:
        """Copies one layer of these pages L2 -> L1: the native chunk copy, else vectorised row copies
        over row tables computed once for the batch."""
        src, dst = self.host_pool, self.device_pool
        kernel = device_copy.select_device_copy(src, dst, self.io_backend)
        if kernel is not None:
            return kernel.layer_copier(src, src_pages, dst, dst_pages)
        if cpu_copy.native_available() and self.io_backend == "kernel":
            return partial(cpu_copy.copy_page_chunks, src, src_pages, dst, dst_pages)
        src_table, src_rows, dst_table, dst_rows = paired_page_rows(src, src_pages, dst, dst_pages)
        return partial(copy_layer_rows, src_table, src_rows, src.row_dim_order, dst_table, dst_rows,
                       dst.row_dim_order)

    def write_now(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> BaseException | None:
        """Copy L1 -> L2 and wait (write_back on eviction); returns the error if the copy failed (the
        caller keeps the KV out of L2). Bad slots raise ValueError (nothing copied); an interrupt
        (KeyboardInterrupt, SystemExit) propagates, and the caller must treat the copy as failed."""
        return self._copy_now("write", device_slots, host_slots)

    def load_now(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> BaseException | None:
        """Copy L2 -> L1 and wait (an exclusive tier's chunked load back); errors as :meth:`write_now`
        (on an error the caller must not use the destination slots' KV)."""
        return self._copy_now("load", host_slots, device_slots)

    def _copy_now(self, kind: str, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> BaseException | None:
        if self.use_cuda:
            run = partial(self._copy_now_cuda, kind)
        else:
            run = self._cpu_copies[kind].run_now
        error = _copy_here(kind, run, src_slots, dst_slots)
        raise_interrupt(error)
        return error

    def _copy_now_cuda(self, kind: str, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        src, dst = (self.device_pool, self.host_pool) if kind == "write" else (self.host_pool, self.device_pool)
        src_pages, dst_pages = _page_mapping(kind, src, src_slots, dst, dst_slots)
        stream = torch.cuda.current_stream(self.device_pool.device)
        stream.synchronize()
        copy_pages(src, src_pages, dst, dst_pages, self.io_backend)
        stream.synchronize()

    @staticmethod
    def num_done(acks: deque[Ack]) -> int:
        """How many operations at the head of ``acks`` are complete (FIFO: stops at the first pending)."""
        n = 0
        for handle, _ in acks:
            if not handle.done():
                break
            n += 1
        return n

    @staticmethod
    def pop_done(acks: deque[Ack], n: int) -> list[Ack]:
        """Remove the first ``n`` acks (the caller agreed they are done; waits if one is not yet)."""
        if n == 1:  # most polls, spelt out: right after a copy each step of a loop costs ~0.1 us more
            ack = acks.popleft()
            ack[0].wait()
            return [ack]
        out = []
        for _ in range(n):
            ack = acks.popleft()
            ack[0].wait()
            out.append(ack)
        return out

    def _submit(self, kind: str, src: PagedKVBuffer, src_slots: torch.Tensor, dst: PagedKVBuffer,
                dst_slots: torch.Tensor, acks: deque[Ack], payload: Any) -> CopyHandle:
        """Start a copy and queue its ack. A copy run here reports its failure on the handle, like one
        run by the worker; an interrupt is re-raised only once the failed ack is queued, so that the ack
        releases the slots and locks of ``payload`` as for any failed copy."""
        if self.use_cuda:
            handle = self._submit_cuda(kind, src, src_slots, dst, dst_slots)
        elif self._copy_inline(kind, src_slots):
            return _ack_here(acks, payload, _copy_here(kind, self._cpu_copies[kind].run_now, src_slots, dst_slots))
        else:
            handle = self._submit_to_worker(kind, src_slots, dst_slots)
        acks.append((handle, payload))
        if handle.error is not None:
            raise_interrupt(handle.error)
        return handle

    def _submit_to_worker(self, kind: str, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> CopyHandle:
        copy = self._cpu_copies[kind]
        mapping = copy.check(src_slots, dst_slots)
        handle = CopyHandle()

        def job() -> None:
            try:
                if self.delay_hook is not None:
                    self.delay_hook(kind)
                copy.run(mapping)
            except BaseException as exc:  # reported through the handle, never lost in the thread
                log.error("%s copy failed: %r", kind, exc)
                handle.error = exc
            finally:
                handle.cpu_event.set()
            raise_interrupt(handle.error)  # run by a waiting thread: Ctrl-C reaches it (the worker ignores it)

        self._worker.submit(handle, job)
        handle.run_here = partial(self._run_here, handle)
        return handle

    def _submit_cuda(self, kind: str, src: PagedKVBuffer, src_slots: torch.Tensor, dst: PagedKVBuffer,
                     dst_slots: torch.Tensor) -> CopyHandle:
        src_pages, dst_pages = _page_mapping(kind, src, src_slots, dst, dst_slots)
        handle = CopyHandle()
        stream = self._write_stream if kind == "write" else self._load_stream
        stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        with torch.cuda.stream(stream):
            copy_pages(src, src_pages, dst, dst_pages, self.io_backend)
            handle.cuda_event = torch.cuda.Event()
            handle.cuda_event.record(stream)
        return handle

    def _copy_inline(self, kind: str, src_slots: torch.Tensor) -> bool:
        """True when a CPU copy is better run here than handed to the worker: a load (its callers wait
        for it at once: a hand-off would only add its own cost) or a small write, when nothing is queued
        or running ahead of it (copies still land in submission order) and no test delays copies.
        The handle and ack queues behave the same; the ack is simply complete at once."""
        if self.delay_hook is not None:
            return False
        if (kind == "write" and self.overlap_writes
                and len(src_slots) * self._cpu_copies[kind].bytes_per_slot > _INLINE_COPY_MAX_BYTES):
            return False
        return self._worker.idle()

    def _run_here(self, handle: CopyHandle) -> None:
        if self.delay_hook is None:  # a test's hook may block until this thread releases it
            self._worker.run_until(handle)

    def synchronize(self) -> None:
        """Block until every queued copy has finished."""
        for acks in (self.writes, self.loads):
            for handle, _ in acks:
                handle.wait()

    def shutdown(self) -> None:
        """Finish queued copies and stop the worker thread."""
        if not self.use_cuda:
            self._worker.stop(timeout_s=30)


class _SlotCopy:
    """CPU copies of whole pages from one pool to another, given token slots: the native chunk copy with
    its layout work done once (one native call per copy, slot checks included), else :func:`copy_pages`
    over the allocators' page mapping.

    A write into a host pool that keeps digests (an L3 store takes them) hashes each page as it writes it
    where the native copy can (page-first host layouts); any other write clears the pages' digests."""

    def __init__(self, kind: str, src: PagedKVBuffer, dst: PagedKVBuffer, io_backend: str) -> None:
        self.kind, self.src, self.dst, self.io_backend = kind, src, dst, io_backend
        self.bytes_per_slot = src.spec.bytes_per_token
        native = (io_backend == "kernel" and cpu_copy.native_available()
                  and device_copy.select_device_copy(src, dst, io_backend) is None)
        self.digests = dst.digests if isinstance(dst, HostKVPool) else None
        self.chunks = cpu_copy.ChunkCopy(src, dst, name=kind, digests=self.digests) if native else None
        if self.chunks is not None and self.digests is None:  # never hashes (loads): one call fewer per copy
            self.run_now = self.chunks.copy_slots

    def _hash_pages(self, dst_slots: Any) -> bool:
        """Whether this copy records its destination pages' digests; where the table is on and the copy
        cannot hash, their old digests are cleared here first."""
        if self.digests is None or not self.digests.enabled:
            return False
        if self.chunks is not None and self.chunks.hashes_pages:
            return True
        self.digests.forget_slots(dst_slots)
        return False

    def check(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> tuple:
        """What :meth:`run` needs, from slots checked now (ValueError: bad slots) and held as copies of
        their own: the copy may run later, on another thread."""
        if self.chunks is None:
            return _page_mapping(self.kind, self.src, src_slots, self.dst, dst_slots)
        mapping = (np.array(src_slots.numpy(), dtype=np.int64), np.array(dst_slots.numpy(), dtype=np.int64))
        self.chunks.copy_slots(*mapping, check_only=True)
        return mapping

    def run(self, mapping: tuple) -> None:
        if self.chunks is None:  # a page mapping: its destination pages' digests cleared, never made
            if self.digests is not None:
                self.digests.forget_pages(mapping[1])
            copy_pages(self.src, mapping[0], self.dst, mapping[1], self.io_backend)
        else:
            self.chunks.copy_slots(*mapping, False, self._hash_pages(mapping[1]))

    def run_now(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Check and copy at once (ValueError: bad slots, nothing copied)."""
        if self.chunks is None:
            self.run(self.check(src_slots, dst_slots))
        else:
            self.chunks.copy_slots(src_slots, dst_slots, False, self._hash_pages(dst_slots))


class _CopyWorker:
    """One thread that runs CPU copies in submission order, one at a time.

    A thread waiting for a copy the worker has not started runs it (and the copies queued ahead of it)
    itself: a waited-for copy then costs no hand-off, and order holds because copies never overlap.
    Lock contract: ``_cond``'s lock guards every change to ``_jobs``, ``_busy`` and ``_stopping``; no copy
    runs under it; :meth:`idle` reads ``_jobs`` and ``_busy`` without it (see there).
    """

    def __init__(self) -> None:
        self._jobs: deque[tuple[CopyHandle, Callable[[], None]]] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._busy = False  # a copy is running, on the worker or on a waiting thread
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tierkv-transfer", daemon=True)
        self._thread.start()

    def submit(self, handle: CopyHandle, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append((handle, job))
            self._cond.notify()

    def idle(self) -> bool:
        """Nothing queued or running. Read without the lock (a lock round trip is a measurable part of a
        small load): only the submitting thread adds jobs, and whoever takes a job sets ``_busy`` before
        popping it, so an empty queue read first and a clear ``_busy`` read after mean no copy is running."""
        return not self._jobs and not self._busy

    def run_until(self, handle: CopyHandle) -> None:
        """Run the queued copies up to ``handle``'s on this thread, unless a copy is running already
        (then the caller waits for the worker as before)."""
        while True:
            with self._cond:
                if self._busy or not any(queued is handle for queued, _ in self._jobs):
                    return
                self._busy = True  # before the pop: idle() reads the two without the lock
                queued, job = self._jobs.popleft()
            self._run_one(job)
            if queued is handle:
                return

    def stop(self, timeout_s: float) -> None:
        """Run what is queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _run_one(self, job: Callable[[], None]) -> None:
        try:
            job()  # jobs report their own errors on their handles
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._busy or (not self._jobs and not self._stopping):
                    self._cond.wait()
                if not self._jobs:
                    return
                self._busy = True  # before the pop, as in run_until
                _, job = self._jobs.popleft()
            try:
                self._run_one(job)
            except BaseException:  # an interrupt a job re-raises for a waiting thread: here, on to the next
                pass
