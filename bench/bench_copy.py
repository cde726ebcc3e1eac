"""L1 <-> L2 page copies through tierkv's transfer controller, beside two baselines that move the same bytes.

tierkv: the controller's two copies a caller waits for, slot checks and any hand-off to the copy thread
included: ``TransferController.write_now(device_slots, host_slots)`` (L1 -> L2, as an eviction under
write_back does) and ``load(host_slots, device_slots)`` then ``wait()`` and the ack (L2 -> L1, as a load
back does). (A write-through, ``write()``, is not waited for: above 256 KiB it goes to the copy thread.)

Baselines, timed in the same process and interleaved with it:
- ``gather``: the same work with one vectorised torch index op, ``torch.index_select(l1_rows, 0, index,
  out=buffer)`` over the L1 pool's own layout: the same scattered L1 pages, rows taken in the L2 layout's
  memory order (so a page-first L2 costs the same transposition; whole pages as one row where both
  layouts keep a page's rows adjacent), into a contiguous buffer of the same bytes. It is a gather in
  both directions (a load's scatter into L1 would be the costlier op).
- ``contiguous``: ``dst.copy_(src)`` of two contiguous buffers of the same bytes, a speed-of-light bound
  (at a few MiB both stay in the CPU caches, which no page copy can do).

Pages are laid out as an engine sees them (``--pattern fragmented``): an ascending but gappy subset of L1
(the allocator's sorted free list after churn) and one fresh run in L2 (the host allocator hands out
runs); ``shuffled`` takes L1 pages in random order, ``both-fragmented`` fragments L2 as well.

Each repeat times every operation as the best of several calls (wall clock: the copy thread's time must
count); ratios are baseline time over tierkv time per repeat (above 1: tierkv is faster), shown as
min/median over the interleaved repeats.

    python bench/bench_copy.py [--repeats 5] [--tokens 64,256,1024,8192] [--page-sizes 1,16]
                               [--cases mha:layer_first,mha:page_first,mla:page_first] [--pool-tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.copy.transfer import TransferController
from tierkv.pools import DeviceKVPool, HostKVPool, KVSpec
from tierkv.pools.kv import paired_page_rows


def best_s(fn, min_time_s: float = 0.02, min_calls: int = 3) -> float:
    """Best wall seconds per call over calls filling at least ``min_time_s`` (after one warm-up call)."""
    fn()
    samples: list[float] = []
    while len(samples) < min_calls or sum(samples) < min_time_s:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def make_spec(attention: str, num_layers: int) -> KVSpec:
    if attention == "mla":  # DeepSeek's latent: 512 + 64 wide, 1 KiB + 128 B a token per layer
        return KVSpec(num_layers, attention="mla", kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    return KVSpec(num_layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def page_sets(device: DeviceKVPool, host: HostKVPool, num_pages: int, pattern: str, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    device_pages = torch.randperm(device.num_pages, generator=g)[:num_pages]
    if pattern != "shuffled":
        device_pages = device_pages.sort().values
    if pattern == "both-fragmented":
        host_pages = torch.randperm(host.num_pages, generator=g)[:num_pages].sort().values
    else:
        first = int(torch.randint(0, host.num_pages - num_pages + 1, (1,), generator=g))
        host_pages = torch.arange(first, first + num_pages)
    return device_pages, host_pages


def gather_rows(device: DeviceKVPool, device_pages: torch.Tensor, host: HostKVPool, host_pages: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The L1 pool's byte-row table and the row indices of the pages' rows in the host layout's memory
    order: token rows, or one row per page and (kv, layer) where a page's token rows are adjacent in both
    layouts (fewer, larger rows: the strongest one-op gather)."""
    table, rows, _, _ = paired_page_rows(device, device_pages, host, host_pages)  # [kv, layers, pages, k]
    return table, rows.permute(host.row_dim_order).reshape(-1).contiguous()


_FLAT: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def flat_buffers(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous baseline's source and destination, made once per size for the whole run: buffers made
    anew per case land wherever the allocator has room after the pools (one run measured the page-16
    case's copy_ at 8 GB/s against 12 in the page-1 case), and a baseline must not move between cases."""
    if nbytes not in _FLAT:
        _FLAT[nbytes] = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    return _FLAT[nbytes]


def measure_case(transfer: TransferController, num_tokens: int, pattern: str, repeats: int) -> dict:
    """Seconds per call of tierkv and both baselines, per direction and repeat."""
    device, host = transfer.device_pool, transfer.host_pool
    device_pages, host_pages = page_sets(device, host, num_tokens // device.page_size, pattern, num_tokens)
    device_slots = device.allocator.pages_to_slots(device_pages)
    host_slots = host.allocator.pages_to_slots(host_pages)
    nbytes = num_tokens * device.spec.bytes_per_token
    table, index = gather_rows(device, device_pages, host, host_pages)
    gathered = torch.zeros((len(index), table.shape[1]), dtype=torch.uint8)
    flat_src, flat_dst = flat_buffers(nbytes)

    def write() -> None:
        if transfer.write_now(device_slots, host_slots) is not None:
            raise RuntimeError("write_now failed")

    def load() -> None:
        transfer.load(host_slots, device_slots).wait()
        transfer.pop_done(transfer.loads, 1)

    ops = {"write": write, "load": load,
           "gather": lambda: torch.index_select(table, 0, index, out=gathered),
           "contiguous": lambda: flat_dst.copy_(flat_src)}
    times: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for r in range(repeats):  # rotate the order so that drift on a shared machine hits all alike
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(best_s(ops[name]))
    return {"nbytes": nbytes, "times": times}


def ratio_cells(baseline: list[float], measured: list[float]) -> str:
    ratios = [b / m for b, m in zip(baseline, measured)]
    return f"{min(ratios):>5.2f}/{statistics.median(ratios):<5.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mha:layer_first,mha:page_first,mla:page_first",
                        help="attention:host_layout pairs (attention mha or mla)")
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--tokens", default="64,256,1024,8192", help="tokens per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pattern", default="fragmented", choices=["fragmented", "shuffled", "both-fragmented"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--pool-tokens", type=int, default=0,
                        help="L1 tokens (L2 twice that); 0: twice the largest batch. A pool far larger than the "
                             "caches, as an engine's, makes each scattered page a cache miss")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.tokens.split(",")]
    for attention in {case.split(":")[0] for case in args.cases.split(",")}:  # before any pool
        for num_tokens in sizes:
            flat_buffers(num_tokens * make_spec(attention, args.layers).bytes_per_token)
    pool_tokens = args.pool_tokens or 2 * max(sizes)
    print(f"{args.layers} layers bf16, pattern {args.pattern}, {torch.get_num_threads()} torch threads, "
          f"L1 {pool_tokens} tokens, L2 twice that, {args.repeats} interleaved repeats; "
          f"ratios = baseline time / tierkv time, min/median")
    print(f"{'case':<17}{'page':>5}{'dir':>6}{'tokens':>7}{'MiB':>7}{'tierkv GB/s':>12}{'gather GB/s':>12}"
          f"{'contig GB/s':>12}{'vs gather':>13}{'vs contig':>13}")
    for case in args.cases.split(","):
        attention, layout = case.split(":")
        spec = make_spec(attention, args.layers)
        for page_size in (int(p) for p in args.page_sizes.split(",")):
            device = DeviceKVPool(spec, pool_tokens, page_size, "cpu")
            device.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
            host = HostKVPool(spec, 2 * pool_tokens, page_size, layout, pin_memory=False)
            transfer = TransferController(device, host, "kernel")
            try:
                for num_tokens in sizes:
                    result = measure_case(transfer, num_tokens, args.pattern, args.repeats)
                    print_rows(case, page_size, num_tokens, result)
            finally:
                transfer.shutdown()
            del device, host, transfer


def print_rows(case: str, page_size: int, num_tokens: int, result: dict) -> None:
    nbytes, times = result["nbytes"], result["times"]

    def gbs(name: str) -> float:
        return nbytes / statistics.median(times[name]) / 1e9

    for direction in ("write", "load"):
        print(f"{case:<17}{page_size:>5}{direction:>6}{num_tokens:>7}{nbytes / 2**20:>7.1f}{gbs(direction):>12.2f}"
              f"{gbs('gather'):>12.2f}{gbs('contiguous'):>12.2f}"
              f"{ratio_cells(times['gather'], times[direction]):>13}"
              f"{ratio_cells(times['contiguous'], times[direction]):>13}", flush=True)


if __name__ == "__main__":
    main()
