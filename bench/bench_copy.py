"""L1 <-> L2 copy throughput of each io backend and host layout, beside a plain torch copy of the same bytes.

For each batch size the pages to copy are laid out as an engine sees them (``--pattern fragmented``):
an ascending but gappy subset of L1 (the allocator's sorted free list after churn) and one fresh run in
L2 (the host allocator hands out runs). ``shuffled`` takes L1 pages in random order (worst case),
``both-fragmented`` fragments L2 as well, ``contiguous`` is one run on both sides. The baseline is
``dst.copy_(src)`` of two contiguous tensors of the same size, timed in the same process, interleaved
with the measured copies; the ratio is backend GB/s over plain-copy GB/s.

    python bench/bench_copy.py [--page-size 1] [--sizes 16,64,256,1024,4096] [--mla]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, HostKVPool, KVSpec  # noqa: E402
from tierkv.transfer import copy_pages  # noqa: E402


def timed_s(fn, clock=time.thread_time, min_time_s: float = 0.03, min_reps: int = 3) -> float:
    """Best seconds per call over repetitions filling at least ``min_time_s``.

    The default clock is this thread's CPU time, so that other processes on a shared machine do not
    count; with one torch thread every copy runs on this thread.
    """
    fn()  # warm up
    samples: list[float] = []
    while len(samples) < min_reps or sum(samples) < min_time_s:
        start = clock()
        fn()
        samples.append(clock() - start)
    return min(samples)


def page_sets(device: DeviceKVPool, host: HostKVPool, num_pages: int, pattern: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    device_pages = torch.randperm(device.num_pages, generator=g)[:num_pages]
    if pattern != "shuffled":
        device_pages = device_pages.sort().values
    if pattern == "contiguous":
        device_pages = torch.arange(num_pages)
    if pattern == "both-fragmented":
        host_pages = torch.randperm(host.num_pages, generator=g)[:num_pages].sort().values
    else:
        first = int(torch.randint(0, host.num_pages - num_pages + 1, (1,), generator=g))
        host_pages = torch.arange(first, first + num_pages)
    return device_pages, host_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--sizes", default="16,64,256,1024,4096", help="tokens per batch")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mla", action="store_true", help="an MLA latent (576 wide) instead of MHA")
    parser.add_argument("--pattern", default="fragmented",
                        choices=["fragmented", "shuffled", "both-fragmented", "contiguous"])
    parser.add_argument("--layouts", default=",".join(HOST_LAYOUTS))
    parser.add_argument("--backends", default="kernel,direct")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (more: wall-clock timing)")
    parser.add_argument("--l1-tokens", type=int, default=8192,
                        help="L1 pool size (at least twice the largest batch); L2 is twice L1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.mla:
        spec = KVSpec(args.layers, attention="mla", kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    else:
        spec = KVSpec(args.layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    pool_tokens = max(args.l1_tokens, 2 * max(sizes))
    ps = args.page_size
    device = DeviceKVPool(spec, pool_tokens, ps, "cpu")
    device.buffer.copy_(torch.randn(device.buffer.shape).to(spec.dtype))
    print(f"{spec.attention} {args.layers} layers, {spec.bytes_per_token // 1024} KiB/token, page_size {ps}, "
          f"pattern {args.pattern}, {torch.get_num_threads()} torch threads, L1 {pool_tokens} tokens")
    print(f"{'backend':<8}{'layout':<19}{'dir':<6}{'tokens':>7}{'MiB':>8}{'GB/s':>8}{'plain GB/s':>12}{'ratio':>7}")
    for layout in args.layouts.split(","):
        host = HostKVPool(spec, 2 * pool_tokens, ps, layout, pin_memory=False)
        for num_tokens in sizes:
            num_pages = num_tokens // ps
            nbytes = num_pages * device.page_nbytes
            src_plain = torch.ones(nbytes, dtype=torch.uint8)
            dst_plain = torch.zeros(nbytes, dtype=torch.uint8)
            dev_pages, host_pages = page_sets(device, host, num_pages, args.pattern, seed=num_tokens)
            for backend in args.backends.split(","):
                for direction in ("write", "load"):
                    if direction == "write":
                        copy = lambda: copy_pages(device, dev_pages, host, host_pages, backend)  # noqa: E731
                    else:
                        copy = lambda: copy_pages(host, host_pages, device, dev_pages, backend)  # noqa: E731
                    plain_s, copy_s = [], []
                    for _ in range(3):  # interleave so that machine noise hits both alike
                        plain_s.append(timed_s(lambda: dst_plain.copy_(src_plain), clock))
                        copy_s.append(timed_s(copy, clock))
                    plain_gbs, gbs = nbytes / min(plain_s) / 1e9, nbytes / min(copy_s) / 1e9
                    print(f"{backend:<8}{layout:<19}{direction:<6}{num_tokens:>7}{nbytes / 2**20:>8.1f}"
                          f"{gbs:>8.2f}{plain_gbs:>12.2f}{gbs / plain_gbs:>7.2f}")
        del host


if __name__ == "__main__":
    main()
