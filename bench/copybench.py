"""L1 <-> L2 copy bandwidth through the transfer controller, per I/O backend and host layout, on any
device (bench/gpu_check.sh runs it on CUDA; bench/bench_copy.py is the CPU copy benchmark with a
same-work baseline).

The baseline row is one plain ``tensor.copy_`` of the same bytes (device buffer to a host buffer),
so each row's ratio says how close the paged copy gets to a flat copy on this machine.

    python bench/copybench.py [--device cuda] [--mib 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.pools.kv import DeviceKVPool, HostKVPool  # noqa: E402
from tierkv.pools.spec import KVSpec  # noqa: E402
from tierkv.copy.transfer import TransferController, resolve_host_layout  # noqa: E402

CASES = (("kernel", "layer_first"), ("kernel", "page_first"), ("direct", "page_first_direct"))


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: first touches and lazy CUDA setup
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def measure(device: str, size_mib: int, page_size: int = 16, repeats: int = 3,
            scatter: bool = True) -> list[dict]:
    """GB/s of writing (L1 -> L2) and loading (L2 -> L1) ``size_mib`` of KV, pages shuffled if ``scatter``."""
    spec = KVSpec(num_layers=8, kv_heads=8, head_dim=128, dtype=torch.float16)
    num_tokens = max(page_size, (size_mib << 20) // spec.bytes_per_token // page_size * page_size)
    dev = torch.device(device)
    device_pool = DeviceKVPool(spec, num_tokens, page_size, dev)
    nbytes = num_tokens * spec.bytes_per_token
    flat_host = torch.empty(device_pool.buffer.shape, dtype=spec.dtype, pin_memory=dev.type == "cuda")
    flat_s = _timed(lambda: flat_host.copy_(device_pool.buffer, non_blocking=True), dev, repeats)
    rows = [{"case": "flat tensor copy (baseline)", "write_gbps": nbytes / flat_s / 1e9,
             "load_gbps": None, "mib": nbytes >> 20}]
    for io_backend, layout in CASES:
        host_pool = HostKVPool(spec, num_tokens, page_size, resolve_host_layout(layout, io_backend))
        transfer = TransferController(device_pool, host_pool, io_backend)
        device_slots = device_pool.alloc(num_tokens)
        host_slots = host_pool.alloc(num_tokens)
        if scatter:
            order = torch.randperm(num_tokens // page_size, generator=torch.Generator().manual_seed(0))
            host_slots = host_slots.view(-1, page_size)[order].reshape(-1)
        write_s = _timed(lambda: transfer.write(device_slots, host_slots).wait(), dev, repeats)
        load_s = _timed(lambda: transfer.load(host_slots, device_slots).wait(), dev, repeats)
        transfer.synchronize()
        transfer.shutdown()
        device_pool.free(device_slots)
        rows.append({"case": f"{io_backend}/{layout}", "write_gbps": nbytes / write_s / 1e9,
                     "load_gbps": nbytes / load_s / 1e9, "mib": nbytes >> 20})
    return rows


def format_rows(rows: list[dict]) -> str:
    base = rows[0]["write_gbps"]
    lines = [f"{'L1<->L2 copy':<28} {'MiB':>6} {'write GB/s':>10} {'load GB/s':>10} {'write vs flat':>13}"]
    for r in rows:
        load = f"{r['load_gbps']:.2f}" if r["load_gbps"] is not None else "-"
        lines.append(f"{r['case']:<28} {r['mib']:>6} {r['write_gbps']:>10.2f} {load:>10} "
                     f"{r['write_gbps'] / base:>12.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/copybench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = measure(args.device, args.mib)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
