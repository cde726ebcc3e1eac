"""Accelerator <-> host page copies for the ``kernel`` io backend: one gather or scatter on the device
and one DMA per contiguous stretch of host memory.

A page's KV is scattered over both pools (one piece per K/V and layer, and per token in page-first
layouts), and a cross-device ``copy_`` of a non-dense view goes through pageable temporaries, which
makes it slow and synchronous. Instead, a write gathers the pages' rows on the device into a staging
buffer laid out in the host's memory order, then copies each contiguous host stretch from it; a load
does the reverse with a scatter (``index_copy_``) on the device. Both stay on the caller's stream and
are asynchronous against pinned host memory. When the host pages are too fragmented for a few DMAs
(the host allocator normally hands out runs), :func:`staged_copy` declines and the caller copies by run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.copy.cpu_copy import page_segments
from tierkv.pools.kv import PagedKVBuffer, paired_page_rows

if TYPE_CHECKING:
    from tierkv.copy.triton_copy import TritonPageCopy

# Up to this many DMAs per (kv, layer) piece of a page: one run of host pages needs one DMA in
# page-first layouts and one per (kv, layer) in layer_first.
_MAX_SEGMENTS_PER_PIECE = 4


def staged_copy(device_pool: PagedKVBuffer, device_pages: torch.Tensor, host_pool: PagedKVBuffer,
                host_pages: torch.Tensor, to_host: bool, non_blocking: bool = True) -> bool:
    """Copy whole pages device -> host (``to_host``) or host -> device; False (nothing copied) when the
    host side would need too many DMAs. Runs on the current stream; the caller records its event."""
    host_table, host_rows, device_table, device_rows = paired_page_rows(host_pool, host_pages, device_pool,
                                                                        device_pages)
    order = host_pool.row_dim_order
    host_flat, device_flat = host_rows.permute(order).reshape(-1), device_rows.permute(order).reshape(-1)
    segments = page_segments(host_flat, min_rows=1)
    spec = host_pool.spec
    if len(segments) > _MAX_SEGMENTS_PER_PIECE * spec.num_kv * spec.num_layers:
        return False
    device_index = device_flat.to(device_table.device, non_blocking=non_blocking)
    if to_host:
        staging = device_table.index_select(0, device_index)
        for start, end, first_row in segments:
            host_table.narrow(0, first_row, end - start).copy_(staging[start:end], non_blocking=non_blocking)
        return True
    staging = torch.empty((len(host_flat), device_table.shape[1]), dtype=device_table.dtype,
                          device=device_table.device)
    for start, end, first_row in segments:
        staging[start:end].copy_(host_table.narrow(0, first_row, end - start), non_blocking=non_blocking)
    device_table.index_copy_(0, device_index, staging)
    return True


def select_device_copy(src: PagedKVBuffer, dst: PagedKVBuffer, io_backend: str) -> "TritonPageCopy | None":
    """The one-launch Triton copy between these pools when the ``kernel`` backend should use it (on CUDA
    when triton is installed; anywhere with ``TIERKV_COPY_KERNEL=triton``), else None: the torch copies
    here and in :mod:`tierkv.copy.cpu_copy` run. Without triton on CUDA, one log line says how to get it."""
    if io_backend != "kernel":
        return None
    from tierkv.copy.triton_copy import copier_for  # imports no triton until a kernel runs

    return copier_for(src, dst)
