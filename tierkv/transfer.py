"""L1 <-> L2 copies, asynchronous: CUDA streams and events on a GPU, one worker thread on CPU.

Completed copies are acknowledged through FIFO queues the cache polls without blocking. Completion is
reported as "the leading N operations are done" so that tensor-parallel ranks can agree on one number.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tierkv import cpu_copy, device_copy
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
    :mod:`tierkv.cpu_copy`); between an accelerator and the host, a device-side gather or scatter and
    a DMA per contiguous host stretch (:mod:`tierkv.device_copy`); otherwise runs of consecutive pages
    as single strided copies when there are few runs, and token rows with vectorised index copies when
    there are many. ``direct`` copies page by page.
    """
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


def copy_layer(src: PagedKVBuffer, src_pages: torch.Tensor, dst: PagedKVBuffer, dst_pages: torch.Tensor,
               layer: int) -> None:
    """Copy layer ``layer`` of whole pages between pools of any layouts, one index op each way (the
    accelerator path of a layer-wise load; CPU pools use :func:`copy_layer_rows`)."""
    src_layer = src.paged.permute(src.perm).select(1, layer)  # [num_kv, pages, page_size, heads, dim]
    dst_layer = dst.paged.permute(dst.perm).select(1, layer)
    data = src_layer.index_select(1, src_pages.to(src.device))
    dst_layer.index_copy_(1, dst_pages.to(dst.device), data.to(dst.device, non_blocking=True))


def _page_mapping(kind: str, src: PagedKVBuffer, src_slots: torch.Tensor, dst: PagedKVBuffer,
                  dst_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The source and destination pages of a copy; ValueError when their counts differ."""
    src_pages, dst_pages = src.allocator.slots_to_pages(src_slots), dst.allocator.slots_to_pages(dst_slots)
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{kind}: {len(src_slots)} source slots vs {len(dst_slots)} destination slots")
    return src_pages, dst_pages


# CPU copies up to this size run on the submitting thread: a hand-off to the worker (queue, event,
# GIL switches) costs ~100 us, more than copying this many bytes.
_INLINE_COPY_MAX_BYTES = 256 * 1024
_RUN_COPY_MIN_BYTES = 256 * 1024


@dataclass
class CopyHandle:
    """Completion of one batch copy. ``error`` is set when the copy failed (its KV must not be used)."""

    cuda_event: Any = None
    cpu_event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    layer_events: list = field(default_factory=list)  # per layer, for a layer-wise load (CUDA or CPU events)

    def done(self) -> bool:
        if self.cuda_event is not None:
            return self.cuda_event.query()
        return self.cpu_event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        if self.cuda_event is not None:
            self.cuda_event.synchronize()
            return True
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
            self.cpu_event.wait()


@dataclass
class _Queued:
    handle: CopyHandle
    payload: Any


class TransferController:
    """Runs write (L1->L2) and load (L2->L1) batches asynchronously and keeps their ack queues.

    Thread contract: submit and poll from one thread (the scheduler's); only copies run elsewhere.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, io_backend: str = "kernel") -> None:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend {io_backend!r} is not one of {IO_BACKENDS}")
        self.device_pool, self.host_pool, self.io_backend = device_pool, host_pool, io_backend
        self.writes: deque[_Queued] = deque()
        self.loads: deque[_Queued] = deque()
        self.use_cuda = device_pool.device.type == "cuda"
        if self.use_cuda:
            self._write_stream = torch.cuda.Stream(device_pool.device)
            self._load_stream = torch.cuda.Stream(device_pool.device)
        else:
            self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
            self._last_queued: CopyHandle | None = None  # the newest copy handed to the worker
            self._worker = threading.Thread(target=self._run_jobs, name="tierkv-transfer", daemon=True)
            self._worker.start()
        self.delay_hook: Callable[[str], None] | None = None  # tests inject per-rank delays here

    def write(self, device_slots: torch.Tensor, host_slots: torch.Tensor, payload: Any = None) -> CopyHandle:
        """Queue an L1 -> L2 copy of whole pages; its ack carries ``payload``."""
        handle = self._submit("write", self.device_pool, device_slots, self.host_pool, host_slots)
        self.writes.append(_Queued(handle, payload))
        return handle

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, payload: Any = None) -> CopyHandle:
        """Queue an L2 -> L1 copy of whole pages; its ack carries ``payload``."""
        handle = self._submit("load", self.host_pool, host_slots, self.device_pool, device_slots)
        self.loads.append(_Queued(handle, payload))
        return handle

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
                for layer in range(num_layers):
                    copy_layer(src, src_pages, dst, dst_pages, layer)
                    handle.layer_events.append(torch.cuda.Event())
                    handle.layer_events[-1].record(self._load_stream)
            handle.cuda_event = handle.layer_events[-1]
        else:
            handle.layer_events = [threading.Event() for _ in range(num_layers)]
            self._jobs.put(partial(self._copy_layers, handle, src_pages, dst_pages))
            self._last_queued = handle
        self.loads.extend(_Queued(handle, payload) for payload in payloads)
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
        if cpu_copy.native_available() and self.io_backend == "kernel":
            return partial(cpu_copy.copy_page_chunks, src, src_pages, dst, dst_pages)
        src_table, src_rows, dst_table, dst_rows = paired_page_rows(src, src_pages, dst, dst_pages)
        return partial(copy_layer_rows, src_table, src_rows, src.row_dim_order, dst_table, dst_rows,
                       dst.row_dim_order)

    def write_now(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> BaseException | None:
        """Copy L1 -> L2 and wait (write_back on eviction); returns the error if the copy failed."""
        src_pages = self.device_pool.allocator.slots_to_pages(device_slots)
        dst_pages = self.host_pool.allocator.slots_to_pages(host_slots)
        try:
            if self.use_cuda:
                torch.cuda.current_stream(self.device_pool.device).synchronize()
            copy_pages(self.device_pool, src_pages, self.host_pool, dst_pages, self.io_backend)
            if self.use_cuda:
                torch.cuda.current_stream(self.device_pool.device).synchronize()
        except Exception as exc:  # a failed copy is reported, the caller keeps the KV out of L2
            log.error("write-back copy failed: %s", exc)
            return exc
        return None

    @staticmethod
    def num_done(acks: deque[_Queued]) -> int:
        """How many operations at the head of ``acks`` are complete (FIFO: stops at the first pending)."""
        n = 0
        for item in acks:
            if not item.handle.done():
                break
            n += 1
        return n

    @staticmethod
    def pop_done(acks: deque[_Queued], n: int) -> list[tuple[CopyHandle, Any]]:
        """Remove the first ``n`` acks (the caller agreed they are done; waits if one is not yet)."""
        out = []
        for _ in range(n):
            item = acks.popleft()
            item.handle.wait()
            out.append((item.handle, item.payload))
        return out

    def _submit(self, kind: str, src: PagedKVBuffer, src_slots: torch.Tensor, dst: PagedKVBuffer,
                dst_slots: torch.Tensor) -> CopyHandle:
        src_pages, dst_pages = _page_mapping(kind, src, src_slots, dst, dst_slots)
        handle = CopyHandle()
        if self.use_cuda:
            stream = self._write_stream if kind == "write" else self._load_stream
            stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
            with torch.cuda.stream(stream):
                copy_pages(src, src_pages, dst, dst_pages, self.io_backend)
                handle.cuda_event = torch.cuda.Event()
                handle.cuda_event.record(stream)
            return handle

        def job() -> None:
            try:
                if self.delay_hook is not None:
                    self.delay_hook(kind)
                copy_pages(src, src_pages, dst, dst_pages, self.io_backend)
            except BaseException as exc:  # reported through the handle, never lost in the thread
                log.error("%s copy failed: %s", kind, exc)
                handle.error = exc
            finally:
                handle.cpu_event.set()

        if self._copy_inline(self.delay_hook, len(src_pages) * src.page_nbytes):
            job()
        else:
            self._jobs.put(job)
            self._last_queued = handle
        return handle

    def _copy_inline(self, delay_hook: Callable[[str], None] | None, size_bytes: int) -> bool:
        """True when a CPU copy is cheaper run here than handed to the worker: it is small, nothing
        is queued ahead of it (copies still land in submission order) and no test delays copies.
        The handle and ack queues behave the same; the ack is simply complete at once."""
        if delay_hook is not None or size_bytes > _INLINE_COPY_MAX_BYTES:
            return False
        return self._last_queued is None or self._last_queued.cpu_event.is_set()

    def _run_jobs(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def synchronize(self) -> None:
        """Block until every queued copy has finished."""
        for acks in (self.writes, self.loads):
            for item in acks:
                item.handle.wait()

    def shutdown(self) -> None:
        """Finish queued copies and stop the worker thread."""
        if not self.use_cuda and self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=30)
