"""tierkv's HiCache storage backend beside SGLang's own ``file`` backend, both driven by SGLang's calls.

Both keep pages in a directory; SGLang's StorageBackendFactory makes both and SGLang's cache controller calls
both as ``attach_storage_backend`` wires them: its ``file`` backend through the copying page get/set (the
only way SGLang calls it), tierkv's through the zero-copy v1 calls (``"interface_v1": 1``) and, as a third
column, through the copying calls. Each repeat backs up fresh pages (new token ids: every backend skips pages
already stored), then prefetches them back into other host slots (SGLang's hit query and its transfer),
then clears the stores (untimed). Backends take turns inside each repeat; the table gives the median time
per backend and the min and median over repeats of SGLang's time divided by tierkv's (above 1: tierkv is
faster). tierkv's pages carry a checksummed header that every read verifies; SGLang's carry nothing.

Runs in the SGLang venv (scripts/setup_sglang_venv.sh builds it):
    PYTHONPATH=. .venv-sglang/bin/python bench/bench_sglang_storage.py [--pages 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

from tests.sglang_driver import backup, controller, fill, host_pool, prefetch, tokens

BACKENDS = ("sglang-file", "tierkv-v1", "tierkv-copy")


def make_controllers(args, root: Path) -> dict:
    geometry = dict(page_size=args.page_size, num_layers=args.layers, num_heads=args.heads, head_dim=args.head_dim,
                    num_tokens=args.pages * args.page_size)
    made = {}
    for name in BACKENDS:
        pool = host_pool("mha", args.layout, **geometry)
        directory = str(root / name)
        if name == "sglang-file":
            made[name] = controller(pool, {"file_storage_path": directory}, backend="file")
        else:
            made[name] = controller(pool, {"storage_backend": f"file://{directory}",
                                           "interface_v1": int(name == "tierkv-v1")})
    return made


def one_round(ctrl, num_pages: int, seed: int) -> tuple[float, float]:
    """(backup seconds, prefetch seconds) of ``num_pages`` fresh pages; checks every page made it."""
    pool = ctrl.storage_host_pool
    token_ids = tokens(seed, num_pages, pool.page_size)
    source, _ = fill(pool, len(token_ids), seed)
    target = pool.alloc(len(token_ids))
    start = time.perf_counter()
    stored = backup(ctrl, source, token_ids)
    middle = time.perf_counter()
    hit_tokens, pages_read = prefetch(ctrl, token_ids, target)
    end = time.perf_counter()
    pool.free(source)
    pool.free(target)
    ctrl.storage_backend.clear()
    if not stored == hit_tokens == len(token_ids) or pages_read != num_pages:
        raise RuntimeError(f"stored {stored}, hit {hit_tokens}, read {pages_read} pages of {len(token_ids)} tokens")
    return middle - start, end - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=32, help="pages per backup and per prefetch")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8, help="KV heads on this rank")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", default="page_first", choices=["page_first", "page_first_direct", "layer_first"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the stores live (default: a temp dir)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-sglang-l3-"))
    ctrls = make_controllers(args, root)
    page_mib = ctrls["tierkv-v1"].storage_host_pool.get_size_per_token() * args.page_size / 2**20
    times = {name: {"backup": [], "prefetch": []} for name in BACKENDS}
    for repeat in range(args.repeats + 1):  # the first round warms files, allocators and caches: not counted
        for name in BACKENDS:
            write_s, read_s = one_round(ctrls[name], args.pages, seed=1000 * repeat + BACKENDS.index(name))
            if repeat:
                times[name]["backup"].append(write_s)
                times[name]["prefetch"].append(read_s)
    print(f"SGLang HiCache L3 through SGLang's controller calls: MHA {args.layout}, {args.pages} pages of "
          f"{args.page_size} tokens ({page_mib:.2f} MiB each), {args.repeats} interleaved repeats, store in {root}")
    print(f"{'op':<9} {'sglang-file s':>13} {'tierkv-v1 s':>12} {'tierkv-copy s':>13} "
          f"{'v1 speedup min':>15} {'median':>7} {'copy speedup median':>20}")
    for op in ("backup", "prefetch"):
        base = times["sglang-file"][op]
        v1 = [b / t for b, t in zip(base, times["tierkv-v1"][op])]
        copy = [b / t for b, t in zip(base, times["tierkv-copy"][op])]
        medians = [statistics.median(times[name][op]) for name in BACKENDS]
        print(f"{op:<9} {medians[0]:>13.4f} {medians[1]:>12.4f} {medians[2]:>13.4f} {min(v1):>15.2f} "
              f"{statistics.median(v1):>7.2f} {statistics.median(copy):>20.2f}")


if __name__ == "__main__":
    main()
