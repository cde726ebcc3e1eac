"""The worker half of the vLLM connector, free of vLLM imports: L2 bytes, block copies and L3 I/O.

It executes the :class:`tierkv.integrations.vllm_plan.StepPlan` the scheduler half sends each step:
saves copy full vLLM blocks into L2 pages (synchronously, at the end of the step that computed them)
and queue their L3 backup; synchronous loads copy L2 pages into blocks layer by layer as the model
reaches each layer; asynchronous loads (anything from L3) run on a thread and end by reporting the
request finished and any block they could not fill.

An L2 page is one vLLM block of every layer, layers in vLLM's order, each layer's block bytes as vLLM
stores them (tierkv never reinterprets them: the layout is part of the namespace).

Fault contract: L3 reads land in private staging memory and are waited for at most the prefetch
timeout; a read that fails, is corrupt (the store verifies checksums) or is late marks its block and
every later block of the request as a load error, so vLLM recomputes them. Nothing the worker does for
L3 can block a step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.integrations.vllm_config import ConnectorConfig, KVGeometry
from tierkv.integrations.vllm_plan import LoadOp, SaveOp, StepPlan
from tierkv.storage.base import PageStore
from tierkv.storage.worker import IOWorker

log = logging.getLogger(__name__)


@dataclass
class WorkerReport:
    """What the worker half tells the scheduler half after a step."""

    finished_loads: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    backups_done: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, delta: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + delta


@dataclass(eq=False)
class _Read:
    """L3 pages read into private staging memory on the reader thread."""

    keys: list[str]
    staging: torch.Tensor
    ok: list[bool] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, store: PageStore) -> None:
        try:
            self.ok = store.batch_get(self.keys, list(self.staging.unbind(0)))
        except Exception as exc:  # the fault contract says stores do not raise; be safe anyway
            log.warning("tierkv L3 read failed: %s: %s", type(exc).__name__, exc)
            self.ok = [False] * len(self.keys)
        finally:
            self.done.set()


class WorkerTiers:
    """L2 host pages and the copies between them, vLLM's blocks and L3 (see the module docstring).

    Thread contract: vLLM's worker thread calls every public method; the load, reader and backup
    threads only touch blocks and pages the plan gave their job, and report through ``_report``
    under ``_lock``.
    """

    def __init__(self, config: ConnectorConfig, geometry: KVGeometry, store: PageStore | None) -> None:
        self.config, self.geometry, self.store = config, geometry, store
        self.host = torch.zeros((geometry.host_pages, geometry.page_nbytes), dtype=torch.uint8)
        self.layers: list[torch.Tensor] = []  # per layer: [num_blocks, block_nbytes] uint8 views
        self._sync_loads: list[LoadOp] = []
        self._loaded_layers: set[int] = set()
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._load_worker = IOWorker("tierkv-vllm-load")
        self._reader = IOWorker("tierkv-vllm-l3-read") if store is not None else None
        self._backup_worker = IOWorker("tierkv-vllm-l3-write") if store is not None else None
        self._stuck_read: _Read | None = None  # a read past its deadline: L3 is skipped until it returns

    def register(self, layers: list[torch.Tensor]) -> None:
        """Adopt vLLM's per-layer KV tensors (blocks on dim 0); ValueError if their shape is not the geometry's."""
        g = self.geometry
        if len(layers) != g.num_layers:
            raise ValueError(f"{len(layers)} KV layers, expected {g.num_layers}")
        views = []
        for i, layer in enumerate(layers):
            if layer.shape[0] != g.num_device_blocks:
                raise ValueError(f"KV layer {i} has shape {tuple(layer.shape)}, expected "
                                 f"{g.num_device_blocks} blocks on dim 0")
            try:
                flat = layer.view(layer.shape[0], -1).view(torch.uint8)
            except RuntimeError as exc:
                raise ValueError(f"KV layer {i}: a block is not contiguous ({exc})") from None
            if flat.shape[1] != g.block_nbytes:
                raise ValueError(f"KV layer {i}: {flat.shape[1]} bytes per block, expected {g.block_nbytes}")
            views.append(flat)
        self.layers = views
        self._host_pages = self.host.numpy().reshape(g.host_pages, g.num_layers, g.block_nbytes)
        # On CPU, copies go through numpy: a few 4-64 KiB rows per op, where torch's threaded index kernels
        # cost milliseconds on a busy 2-core host and numpy's single-threaded gather costs microseconds.
        # Device KV (vLLM on a GPU) cannot be viewed by numpy: torch index copies to and from the device.
        self._on_device = views[0].device.type != "cpu"
        self._layer_arrays = None if self._on_device else [v.numpy() for v in views]

    # ---- per step ------------------------------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """Start the step's loads: async ones on the load thread, sync ones wait for their layers."""
        self._sync_loads = [op for op in plan.loads if not op.is_async]
        self._loaded_layers = set()
        for op in plan.loads:
            if op.is_async:
                self._load_worker.submit(lambda op=op: self._run_async_load(op))

    def load_layer(self, layer: int) -> None:
        """Copy this layer's part of every sync load (vLLM calls this before the layer's attention)."""
        if layer in self._loaded_layers or not self._sync_loads:
            return
        self._loaded_layers.add(layer)
        for op in self._sync_loads:
            self._copy_in(layer, op.block_ids, self._host_pages[op.host_pages, layer])

    def finish_step(self, plan: StepPlan) -> None:
        """End of the step: finish sync loads no layer hook asked for, run the saves, queue L3 backups."""
        for layer in range(len(self.layers)):
            self.load_layer(layer)
        for op in plan.loads:
            if not op.is_async:
                with self._lock:
                    self._report.add("loaded_l2_tokens", len(op.block_ids) * self.geometry.block_size)
        self._sync_loads = []
        for op in plan.saves:
            self._save(op)

    def _copy_in(self, layer: int, block_ids: list[int], rows: np.ndarray) -> None:
        """Write one layer's block bytes ``rows`` ([blocks, block bytes]) into vLLM's blocks."""
        if self._layer_arrays is not None:
            self._layer_arrays[layer][block_ids] = rows
            return
        target = self.layers[layer]
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=target.device)
        # synchronous: ``rows`` is a view of L2 (or of staging) that may be reused once this returns
        target[index] = torch.from_numpy(np.ascontiguousarray(rows)).to(target.device)

    def _save(self, op: SaveOp) -> None:
        if self._layer_arrays is not None:
            blocks = np.asarray(op.block_ids, dtype=np.int64)
            self._host_pages[op.host_pages] = np.stack([a[blocks] for a in self._layer_arrays], axis=1)
        else:  # one gather per layer on the device, one copy of the batch to the host
            index = torch.as_tensor(op.block_ids, dtype=torch.int64, device=self.layers[0].device)
            batch = torch.stack([layer[index] for layer in self.layers], dim=1).cpu()
            self._host_pages[op.host_pages] = batch.numpy()
        if op.backup_id >= 0 and self._backup_worker is not None:
            self._backup_worker.submit(lambda op=op: self._run_backup(op))

    # ---- background jobs -------------------------------------------------------------------------------
    def _run_async_load(self, op: LoadOp) -> None:
        """L2 pages, then L3 pages through staging; report the request and any block not filled."""
        block_size = self.geometry.block_size
        num_l2 = len(op.host_pages)
        failed: list[int] = []
        try:
            for layer in range(len(self.layers) if num_l2 else 0):
                self._copy_in(layer, op.block_ids[:num_l2], self._host_pages[op.host_pages, layer])
            good = self._read_l3(op.l3_keys)
            l3_blocks = op.block_ids[num_l2:]
            if good.num_pages:
                g = self.geometry
                staged = good.staging[:good.num_pages].numpy().reshape(good.num_pages, g.num_layers, g.block_nbytes)
                for layer in range(len(self.layers)):
                    self._copy_in(layer, l3_blocks[:good.num_pages], staged[:, layer])
            failed = l3_blocks[good.num_pages:]
            loaded_l3 = good.num_pages * block_size
        except Exception as exc:  # a bug here must cost the hit, never the request
            log.exception("tierkv async load of %s failed: %s", op.req_id, exc)
            failed, num_l2, loaded_l3 = list(op.block_ids), 0, 0
        with self._lock:
            self._report.finished_loads.add(op.req_id)
            self._report.load_errors.update(failed)
            self._report.add("loaded_l2_tokens", num_l2 * block_size)
            self._report.add("loaded_l3_tokens", loaded_l3)
            self._report.add("failed_load_tokens", len(failed) * block_size)

    def _read_l3(self, keys: list[str]) -> "_Good":
        """The leading run of ``keys`` read and verified within the prefetch timeout."""
        if not keys or self.store is None:
            return _Good(0, None)
        stuck = self._stuck_read
        if stuck is not None and not stuck.done.is_set():
            return _Good(0, None)  # the store still hangs on an earlier read
        self._stuck_read = None
        read = _Read(keys, torch.empty((len(keys), self.geometry.page_nbytes), dtype=torch.uint8))
        self._reader.submit(lambda: read.run(self.store))
        timeout_s = self.config.storage.prefetch_timeout_s(len(keys) * self.geometry.block_size)
        if not read.done.wait(timeout_s):
            log.warning("tierkv L3 read of %d pages took over %.1f s; recomputing them", len(keys), timeout_s)
            self._stuck_read = read
            return _Good(0, None)
        num_ok = 0
        for ok in read.ok:
            if not ok:
                break
            num_ok += 1
        return _Good(num_ok, read.staging)

    def _run_backup(self, op: SaveOp) -> None:
        written = 0
        try:
            present = self.store.batch_exists(op.keys)
            rest = list(range(present, len(op.keys)))
            if rest:
                ok = self.store.batch_set([op.keys[i] for i in rest], [self.host[op.host_pages[i]] for i in rest])
                written = sum(ok)
        except Exception as exc:  # L3 is a cache: a failed backup is a future miss
            log.warning("tierkv L3 backup failed: %s: %s", type(exc).__name__, exc)
        with self._lock:
            self._report.backups_done.append(op.backup_id)
            self._report.add("backed_up_tokens", written * self.geometry.block_size)

    # ---- reporting ---------------------------------------------------------------------------------------
    def take_finished_loads(self) -> set[str]:
        with self._lock:
            done, self._report.finished_loads = self._report.finished_loads, set()
        return done

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._report.load_errors = self._report.load_errors, set()
        return errors

    def take_report(self) -> WorkerReport:
        """Backups done and counters since the last call (finished loads and errors go through vLLM)."""
        with self._lock:
            report = WorkerReport(backups_done=self._report.backups_done, counters=self._report.counters)
            self._report.backups_done, self._report.counters = [], {}
        return report

    def close(self) -> None:
        timeout_s = self.config.storage.io_wait_timeout_s
        stopped = self._load_worker.stop(timeout_s)
        for worker in (self._reader, self._backup_worker):
            if worker is not None:
                stopped &= worker.stop(timeout_s)
        if stopped and self.store is not None:
            self.store.close()


@dataclass
class _Good:
    num_pages: int
    staging: torch.Tensor | None
