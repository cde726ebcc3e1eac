"""L1 <-> L2 copies on a GPU against the link: the transfer controller's writes, loads and layer-wise loads
per io_backend, host layout and copy path (Triton kernel or torch), each beside one flat pinned ``copy_``
of the same bytes in the same direction; then how much a load running beside a forward pass slows it.

Every ratio is flat-copy time / tierkv time (1.0: the link's speed), taken per repeat, with the operations
interleaved within each repeat, shown as min/median over the repeats. Each operation in a repeat is the
best of a few calls (wall clock with a device sync: the path the cache runs, Python included). Pages are
shuffled on both sides. The overlap row times a matmul-heavy "forward" on the compute stream alone and
while a 4096-token load runs on the controller's load stream (CUDA events on the compute stream), and
shows with-load / alone (1.0: no slowdown).

    python bench/bench_gpu_copy.py --device cuda          # Llama-3-8B-shaped KV, 64/512/4096 tokens
    python bench/bench_gpu_copy.py --tiny                 # CPU: a seconds-long run that the code works
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.copy import triton_copy  # noqa: E402
from tierkv.pools import DeviceKVPool, HostKVPool, KVSpec  # noqa: E402
from tierkv.copy.transfer import TransferController, resolve_host_layout  # noqa: E402

# (io_backend, host layout, copy path): the kernel backend on both paths, the direct one (torch, per page)
CASES = (("kernel", "layer_first", "triton"), ("kernel", "layer_first", "torch"),
         ("kernel", "page_first", "triton"), ("kernel", "page_first", "torch"),
         ("kernel", "page_first_direct", "triton"), ("kernel", "page_first_direct", "torch"),
         ("direct", "page_first_direct", "torch"), ("direct", "layer_first", "torch"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn: Callable[[], None], device: torch.device, calls: int) -> float:
    """Best wall seconds of ``calls`` calls, each synchronised (after one warm-up call)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def copy_path(path: str):
    """The controller picks its copy per call from TIERKV_COPY_KERNEL: set it for one operation."""
    before = os.environ.get(triton_copy.ENV_VAR)
    os.environ[triton_copy.ENV_VAR] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(triton_copy.ENV_VAR, None)
        else:
            os.environ[triton_copy.ENV_VAR] = before


class Setup:
    """One L1 pool, one L2 pool per host layout, one controller per (io_backend, layout), flat buffers."""

    def __init__(self, spec: KVSpec, page_size: int, max_tokens: int, device: torch.device,
                 cases: tuple[tuple[str, str, str], ...]) -> None:
        self.spec, self.page_size, self.device, self.cases = spec, page_size, device, cases
        pool_tokens = 2 * max_tokens
        self.device_pool = DeviceKVPool(spec, pool_tokens, page_size, device)
        pinned = device.type == "cuda"
        self.hosts = {layout: HostKVPool(spec, pool_tokens, page_size, layout, pin_memory=pinned)
                      for layout in {resolve_host_layout(c[1], c[0]) for c in cases}}
        self.controllers = {(io, layout): TransferController(self.device_pool, self.hosts[resolve_host_layout(layout, io)],
                                                             io)
                            for io, layout, _ in cases}
        nbytes = max_tokens * spec.bytes_per_token
        self.flat_device = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.flat_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def slots(self, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device and host slots of ``num_tokens`` tokens on shuffled pages."""
        g = torch.Generator().manual_seed(seed)
        num_pages = num_tokens // self.page_size
        pages = [torch.randperm(self.device_pool.num_pages, generator=g)[:num_pages],
                 torch.randperm(next(iter(self.hosts.values())).num_pages, generator=g)[:num_pages]]
        return (self.device_pool.allocator.pages_to_slots(pages[0]),
                next(iter(self.hosts.values())).allocator.pages_to_slots(pages[1]))

    def close(self) -> None:
        for controller in self.controllers.values():
            controller.synchronize()
            controller.shutdown()


def copy_ops(setup: Setup, num_tokens: int) -> dict[str, Callable[[], None]]:
    """Every operation of one batch size: per case write / load / layer-wise load, and the flat copies."""
    device_slots, host_slots = setup.slots(num_tokens, num_tokens)
    nbytes = num_tokens * setup.spec.bytes_per_token
    flat_d, flat_h = setup.flat_device[:nbytes], setup.flat_host[:nbytes]
    ops = {"flat write": lambda: flat_h.copy_(flat_d, non_blocking=True),
           "flat load": lambda: flat_d.copy_(flat_h, non_blocking=True)}
    for io_backend, layout, path in setup.cases:
        transfer = setup.controllers[(io_backend, layout)]
        name = f"{io_backend}/{resolve_host_layout(layout, io_backend)}/{path}"

        def write(t=transfer, p=path) -> None:
            with copy_path(p):
                t.write(device_slots, host_slots).wait()
            t.pop_done(t.writes, 1)

        def load(t=transfer, p=path) -> None:
            with copy_path(p):
                t.load(host_slots, device_slots).wait()
            t.pop_done(t.loads, 1)

        def layers(t=transfer, p=path) -> None:
            with copy_path(p):
                t.load_layers(host_slots, device_slots, [None]).wait()
            t.pop_done(t.loads, 1)

        ops |= {f"{name} write": write, f"{name} load": load, f"{name} layer-wise": layers}
    return ops


def measure_copies(setup: Setup, sizes: list[int], repeats: int, calls: int) -> list[dict]:
    rows = []
    for num_tokens in sizes:
        ops = copy_ops(setup, num_tokens)
        times: dict[str, list[float]] = {name: [] for name in ops}
        names = list(ops)
        for r in range(repeats):  # rotate the order: drift on the machine hits every operation alike
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(best_s(ops[name], setup.device, calls))
        nbytes = num_tokens * setup.spec.bytes_per_token
        for name, samples in times.items():
            if name.startswith("flat"):
                continue
            flat = times["flat write" if name.endswith("write") else "flat load"]
            ratios = [f / t for f, t in zip(flat, samples)]
            rows.append({"case": name.rsplit(" ", 1)[0], "op": name.rsplit(" ", 1)[1], "tokens": num_tokens,
                         "gbps": nbytes / statistics.median(samples) / 1e9,
                         "flat_gbps": nbytes / statistics.median(flat) / 1e9,
                         "ratio_min": min(ratios), "ratio_median": statistics.median(ratios)})
    return rows


def measure_overlap(setup: Setup, num_tokens: int, repeats: int, matmul_dim: int, matmuls: int) -> dict:
    """Forward time with a concurrent load / alone, per repeat (kernel backend, layer_first, default path)."""
    device = setup.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(matmul_dim, matmul_dim, generator=g).to(device, dtype) / matmul_dim ** 0.5
               for _ in range(matmuls)]
    x0 = torch.randn(matmul_dim, matmul_dim, generator=g).to(device, dtype)
    transfer = setup.controllers[("kernel", "layer_first")]
    device_slots, host_slots = setup.slots(num_tokens, 7)

    def forward_s(with_load: bool) -> float:
        sync(device)
        handle = transfer.load(host_slots, device_slots) if with_load else None
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started_s = time.perf_counter()
        x = x0
        for w in weights:
            x = torch.relu(x @ w)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            elapsed_s = start.elapsed_time(end) / 1e3
        else:
            elapsed_s = time.perf_counter() - started_s
        if handle is not None:
            handle.wait()
            transfer.pop_done(transfer.loads, 1)
        return elapsed_s

    forward_s(True)  # warm-up
    ratios, alone = [], []
    for _ in range(repeats):
        a, b = forward_s(False), forward_s(True)
        alone.append(a)
        ratios.append(b / a)
    return {"tokens": num_tokens, "forward_ms": statistics.median(alone) * 1e3,
            "slowdown_min": min(ratios), "slowdown_median": statistics.median(ratios)}


def verify(setup: Setup, num_tokens: int) -> dict[str, bool]:
    """Per case: a write, a load into other L1 pages and a layer-wise load move exactly the bytes of the
    pages (checked against torch's gather of the source pages), on this device."""
    results = {}
    device_pool = setup.device_pool
    device_pool.buffer.view(torch.uint8).random_(0, 256, generator=None)
    device_slots, host_slots = setup.slots(num_tokens, 99)
    ps = setup.page_size
    used = set(device_slots.tolist())
    back_slots = device_pool.allocator.pages_to_slots(  # loads land on other pages than the written ones
        torch.tensor([p for p in range(device_pool.num_pages) if p * ps not in used][:num_tokens // ps]))
    for io_backend, layout, path in setup.cases:
        transfer = setup.controllers[(io_backend, layout)]
        host = transfer.host_pool
        host_pages = host.allocator.slots_to_pages(host_slots)
        want = device_pool.gather_pages(device_pool.allocator.slots_to_pages(device_slots)).cpu()
        ok = True
        with copy_path(path):
            transfer.write(device_slots, host_slots).wait()
            ok &= _same(host.gather_pages(host_pages), want)
            for layer_wise in (False, True):
                device_pool.buffer[:, :, back_slots] = 0
                handle = (transfer.load_layers(host_slots, back_slots, [None]) if layer_wise
                          else transfer.load(host_slots, back_slots))
                handle.wait()
                ok &= _same(device_pool.gather_pages(device_pool.allocator.slots_to_pages(back_slots)).cpu(), want)
        transfer.pop_done(transfer.writes, len(transfer.writes))
        transfer.pop_done(transfer.loads, len(transfer.loads))
        results[f"{io_backend}/{resolve_host_layout(layout, io_backend)}/{path}"] = ok
    return results


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def format_tables(rows: list[dict], overlap: dict, header: str) -> str:
    sizes = sorted({r["tokens"] for r in rows})
    lines = [header, "", "ratios = flat pinned copy time / tierkv time (1.0 = the link), min/median over repeats"]
    title = f"{'io_backend/layout/path':<34}{'op':<11}" + "".join(f"{f'{n} tok':>14}" for n in sizes)
    lines += [title, "-" * len(title)]
    for case in dict.fromkeys(r["case"] for r in rows):
        for op in ("write", "load", "layer-wise"):
            cells = {r["tokens"]: r for r in rows if r["case"] == case and r["op"] == op}
            lines.append(f"{case:<34}{op:<11}" + "".join(
                f"{cells[n]['ratio_min']:>8.2f}/{cells[n]['ratio_median']:<5.2f}" for n in sizes))
    flat = {r["tokens"]: r for r in rows if r["op"] == "write"}
    lines.append(f"{'flat pinned copy GB/s (write)':<45}" + "".join(f"{flat[n]['flat_gbps']:>14.1f}" for n in sizes))
    flat = {r["tokens"]: r for r in rows if r["op"] == "load"}
    lines.append(f"{'flat pinned copy GB/s (load)':<45}" + "".join(f"{flat[n]['flat_gbps']:>14.1f}" for n in sizes))
    lines += ["", f"overlap (on CPU the load runs before the forward: there the row only checks the code): forward {overlap['forward_ms']:.2f} ms alone; with a {overlap['tokens']}-token load on the "
              f"copy stream: {overlap['slowdown_min']:.3f}/{overlap['slowdown_median']:.3f}x (min/median; 1.0 = none)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/bench_gpu_copy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="on the CPU, tiny KV: checks the script runs")
    parser.add_argument("--tokens", default="64,512,4096")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls per operation and repeat, best kept")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.tiny:
        device, spec = torch.device("cpu"), KVSpec(2, kv_heads=2, head_dim=8, dtype=torch.bfloat16)
        sizes, args.repeats, args.calls, matmul = [64, 256], min(args.repeats, 2), 1, (64, 2)
    else:
        device = torch.device(args.device)
        spec = KVSpec(32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # Llama-3-8B: 128 KiB a token
        sizes, matmul = [int(t) for t in args.tokens.split(",")], (8192, 8)
    cases = CASES
    if not triton_copy.triton_available() or (device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        # on CPU the kernel runs only under Triton's interpreter
        print("Triton rows left out: " + ("triton is not installed (pip install triton)"
                                          if not triton_copy.triton_available() else "no GPU and no TRITON_INTERPRET=1"))
        cases = tuple(c for c in CASES if c[2] != "triton")
    setup = Setup(spec, args.page_size, max(sizes), device, cases)
    try:
        rows = measure_copies(setup, sizes, args.repeats, args.calls)
        overlap = measure_overlap(setup, max(sizes), args.repeats, *matmul)
        exact = verify(setup, min(sizes))
    finally:
        setup.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"L1<->L2 copies on {name}: {spec.num_layers} layers x {spec.kv_heads} KV heads x {spec.head_dim} "
              f"{str(spec.dtype).removeprefix('torch.')} ({spec.bytes_per_token} B a token), page "
              f"{args.page_size}, pages shuffled, {args.repeats} interleaved repeats, best of {args.calls} calls each")
    print(format_tables(rows, overlap, header))
    bad = [case for case, ok in exact.items() if not ok]
    print(f"bit-exact on {device.type} (write, load, layer-wise load of {min(sizes)} tokens, every case): "
          + ("yes" if not bad else "NO: " + ", ".join(bad)))
    if args.json:
        Path(args.json).write_text(json.dumps({"copies": rows, "overlap": overlap, "exact": exact}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
