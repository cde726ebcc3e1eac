"""L3 page stores against their raw backends doing the same work, side by side, at 128 KiB and 8 MiB pages.

For each backend and page size, tierkv's ``batch_set`` / ``batch_get`` of a batch of pages runs in
turns with the raw backend's own client moving the same bytes (``--repeats`` interleaved repeats,
who goes first alternating); the table gives each side's median GB/s and the ratio raw_s / tierkv_s
of each repeat as min / median (1.0 = as fast as raw), and the median ratio of CPU seconds (this
process, all threads: tierkv's extra work, which only a spare core can hide). Raw baselines:
  memory    bytes(page) into a dict / copy back into the target page
  file      per page: open a temp file, write, close, rename over the page's name (same fsync policy)
            / open, readinto the target page, close
  redis     redis-py pipelined SET / GET of the same values, ``--batch-pages`` per round trip; a GET
            reply is copied into its target page (tierkv's get lands pages there too)
  mooncake  the store client's batch_put_from / batch_get_into of the same bytes, one call per batch
The raw sides verify nothing; tierkv writes a header (checksum, xxh3-64, or a MAC with ``--page-key``)
with every page and verifies it on every read. The raw sides run on one thread (one call); tierkv moves a
mooncake batch in ranges on two, each page hashed by the thread that moves it: with a spare core it can
beat raw, the CPU ratio shows the extra work. Targets (issue 27): every store >= 0.9. A last table gives the
memory backend's RSS over the bytes it stores, measured in a fresh subprocess per page size (target <= 1.2).
``--digests`` adds a table of the digests alone.

``--l2-copy`` times a set as the product makes it, an L1 -> L2 copy then the backup's store call, on both
sides: tierkv copies the batch from a CPU L1 pool into a page-first host pool with the transfer controller's
write (which hashes each page as it writes it where the store takes digests: Mooncake) and stores the host
pages with ``batch_set_rows``, handing over those digests as a backup does; raw copies the same pages with
the same native copy, not hashing, into a host pool of its own and stores them with its client as above.
tierkv's get is then a prefetch's: ``batch_get_rows`` into that host pool's rows (the raw side's reads into
the same targets as without the option). The set op is labelled ``c+set``.

    python bench/bench_storage.py [--page-sizes 131072,8388608] [--batch-mib 128] [--repeats 5]
                                  [--backends memory,file,redis,mooncake] [--fsync] [--page-key SECRET]
                                  [--busy-cores 1] [--l2-copy]
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import hmac
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tierkv.copy.cpu_copy import ChunkCopy
from tierkv.copy.transfer import TransferController
from tierkv.hashing import HashNamespace, page_hashes
from tierkv.pools.kv import DeviceKVPool, HostKVPool
from tierkv.pools.spec import KVSpec
from tierkv.storage import mooncake_store, native
from tierkv.storage.factory import open_store
from tierkv.storage.page_format import CHUNK_NBYTES


def best_seconds(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """The digest table's timer: best wall seconds of ``repeats`` calls."""
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Case:
    """One backend: its store, the raw baseline's write and read, and the cleanup between runs. ``ours_set``:
    tierkv's side of a set when not a plain batch_set of the pages (``--l2-copy``)."""

    def __init__(self, name: str, store, raw_set, raw_get, reset) -> None:
        self.name, self.store, self.raw_set, self.raw_get, self.reset = name, store, raw_set, raw_get, reset
        self.before_get: Callable[[], object] | None = None
        self.cleanup: Callable[[], object] = lambda: None
        self.ours_set: Callable[[], object] | None = None
        self.set_label = "set"
        # tierkv's side of a get when not a plain batch_get into the targets (``--l2-copy``), and the pages
        # it lands in (checked against the pages stored)
        self.ours_get: Callable[[], list[bool]] | None = None
        self.got_pages: Callable[[], list[torch.Tensor]] | None = None


class L2Copy:
    """``--l2-copy``: a CPU L1 pool holding the batch and two page-first host pools, one for each side, each
    allocated whole. ``raw_pages``: the raw side's host pages (what its client stores)."""

    def __init__(self, page_nbytes: int, num_pages: int, gen: torch.Generator) -> None:
        page_size = 16 if page_nbytes <= 1 << 20 else 64
        num_layers, rest = divmod(page_nbytes // page_size, 2 * 8 * 128 * 2)  # K and V, 8 heads of 128, fp16
        if rest or not num_layers:
            raise ValueError(f"--l2-copy needs pages of a multiple of {page_size * 4096} bytes, got {page_nbytes}")
        spec = KVSpec(num_layers=num_layers, kv_heads=8, head_dim=128, dtype=torch.float16)
        num_tokens = num_pages * page_size
        self.device = DeviceKVPool(spec, num_tokens, page_size, "cpu")
        self.device.buffer.view(-1).view(torch.uint8).copy_(
            torch.randint(0, 256, (self.device.size_bytes,), dtype=torch.uint8, generator=gen))
        self.device_slots = torch.arange(num_tokens)
        self.host, self.raw_host = (HostKVPool(spec, num_tokens, page_size, "page_first", pin_memory=False)
                                    for _ in range(2))
        self.host_slots, self.raw_slots = self.host.alloc(num_tokens), self.raw_host.alloc(num_tokens)
        self.host_pages = self.host.allocator.slots_to_pages(self.host_slots).numpy()
        self.transfer = TransferController(self.device, self.host)  # the product's write, hashing when on
        self.raw_copy = ChunkCopy(self.device, self.raw_host)  # the same native copy, no digests
        self.raw_copy.copy_slots(self.device_slots, self.raw_slots)
        raw_rows = self.raw_host.page_bytes_array()
        self.raw_pages = [torch.from_numpy(raw_rows[p]) for p in
                          self.raw_host.allocator.slots_to_pages(self.raw_slots).tolist()]

    def attach(self, case: Case, keys: list[str]) -> None:
        """Both sides of ``case``'s set start with their L1 -> L2 copy; tierkv stores as a backup does."""
        store, rows, digests = case.store, self.host.page_bytes_array(), self.host.digests
        if store.accepts_digests:
            digests.enable()
        raw_set = case.raw_set

        def ours_set():
            error = self.transfer.write_now(self.device_slots, self.host_slots)
            if error is not None:
                raise RuntimeError(f"L1 -> L2 copy failed: {error!r}")
            extra = {"digests": digests.lookup(self.host_pages)} if store.accepts_digests else {}
            return store.batch_set_rows(keys, rows, self.host_pages, **extra)

        def raw_with_copy():
            self.raw_copy.copy_slots(self.device_slots, self.raw_slots)
            raw_set()
        case.ours_set, case.raw_set, case.set_label = ours_set, raw_with_copy, "c+set"
        # a get as an L3 prefetch makes it into a page-first pool: the host pool's rows, read in place
        case.ours_get = lambda: store.batch_get_rows(keys, rows, self.host_pages)
        case.got_pages = lambda: [torch.from_numpy(rows[p]) for p in self.host_pages.tolist()]

    def close(self) -> None:
        self.transfer.shutdown()


def store_options(args) -> dict:
    return {"page_key": args.page_key} if args.page_key else {}


def memory_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    store = open_store("memory", ns, page_nbytes, store_options(args))
    raw: dict = {}

    def raw_set():
        for k, p in zip(keys, pages):
            raw[k] = bytes(p.numpy())

    def raw_get():
        for k, t in zip(keys, targets):
            np.copyto(t.numpy(), np.frombuffer(raw[k], dtype=np.uint8))
    return Case("memory", store, raw_set, raw_get, lambda: (store.clear(), raw.clear()))


def file_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    root = tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir)
    store = open_store(f"file://{root}/store", ns, page_nbytes, {"fsync": args.fsync, **store_options(args)})
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir)

    def raw_set():
        for k, p in zip(keys, pages):
            path = os.path.join(raw_dir, k)
            with open(path + ".tmp", "wb", buffering=0) as f:
                f.write(p.numpy())
                if args.fsync:
                    os.fsync(f.fileno())
            os.replace(path + ".tmp", path)

    def raw_get():
        for k, t in zip(keys, targets):
            with open(os.path.join(raw_dir, k), "rb", buffering=0) as f:
                f.readinto(t.numpy())

    def reset():
        store.clear()
        shutil.rmtree(raw_dir)
        os.makedirs(raw_dir)

    def drop_page_cache():
        for directory, _, names in os.walk(root):
            for name in names:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
    case = Case("file", store, raw_set, raw_get, reset)
    case.cleanup = lambda: shutil.rmtree(root, ignore_errors=True)
    if args.cold:
        case.before_get = drop_page_cache
    return case


def redis_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    import redis

    from tests.servers import RedisServer
    server = RedisServer.start()
    store = open_store(server.url, ns, page_nbytes, {"batch_pages": args.batch_pages, "timeout_s": 60.0,
                                                     **store_options(args)})
    client = redis.Redis(port=server.port, socket_timeout=60.0)
    raw_keys = [f"raw:{k}" for k in keys]

    def pipelined(command: str, arg_lists: list[tuple]) -> list:
        replies = []
        for start in range(0, len(arg_lists), args.batch_pages):
            pipe = client.pipeline(transaction=False)
            for one in arg_lists[start:start + args.batch_pages]:
                pipe.execute_command(command, *one)
            replies += pipe.execute()
        return replies

    def raw_set():
        pipelined("SET", [(k, p.numpy().data) for k, p in zip(raw_keys, pages)])

    def raw_get():
        for blob, target in zip(pipelined("GET", [(k,) for k in raw_keys]), targets):
            np.copyto(target.numpy(), np.frombuffer(blob, dtype=np.uint8))

    def reset():
        store.clear()
        client.delete(*raw_keys)
    case = Case("redis", store, raw_set, raw_get, reset)
    case.cleanup = server.stop
    return case


_masters: list = []


def mooncake_master():
    """One master for the whole run: a second client in this process cannot set up against a new
    master once the first one's is gone (its transfer engine keeps the old metadata server)."""
    if not _masters:
        from tests.servers import MooncakeMaster
        _masters.append(MooncakeMaster.start())
        atexit.register(_masters[0].stop)
    return _masters[0]


def mooncake_case(ns: str, page_nbytes: int, keys, pages, targets, args) -> Case:
    master = mooncake_master()
    segment = 3 * len(pages) * (page_nbytes + 4096)  # store + raw copies, with allocator slack
    config = {**master.client_config(), "global_segment_size": segment, "local_buffer_size": 64 << 20,
              **store_options(args)}
    store = open_store(master.url, ns, page_nbytes, config)
    store.batch_exists(keys[:1])  # set up the client outside the timed region
    client = store.client
    if client is None:
        store.close()
        raise RuntimeError(f"mooncake client setup failed ({store.stats.errors} errors)")
    raw_keys = [f"raw:{k}" for k in keys]
    sizes = [page_nbytes] * len(keys)
    # First writes into the segment's untouched memory are many times slower (page faults) and the
    # allocator moves on through it: touch all of it once, or whichever side runs first pays.
    for round_ in range(4):
        codes = client.batch_put_from([f"warm:{round_}:{k}" for k in keys], [p.data_ptr() for p in pages], sizes)
        if any(code != 0 for code in codes):
            break
    client.remove_by_regex("^warm:", True)

    def raw_set():
        codes = client.batch_put_from(raw_keys, [p.data_ptr() for p in pages], sizes)
        assert all(c == 0 for c in codes), codes

    def raw_get():
        client.batch_get_into(raw_keys, [t.data_ptr() for t in targets], sizes)

    def reset():
        store.clear()
        client.remove_by_regex("^raw:", True)
    case = Case("mooncake", store, raw_set, raw_get, reset)
    case.cleanup = store.close
    return case


CASES = {"memory": memory_case, "file": file_case, "redis": redis_case, "mooncake": mooncake_case}


def timed(fn: Callable[[], object], before: Callable[[], object] | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, every thread) of one call of ``fn``."""
    if before is not None:
        before()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(ours: Callable[[], object], raw: Callable[[], object], repeats: int,
                before: Callable[[], object] | None = None) -> list[tuple[tuple, tuple]]:
    """((tierkv wall, cpu), (raw wall, cpu)) seconds of each repeat, the two run in turns (who goes first
    alternating) so that both see the same load."""
    times = []
    for rep in range(repeats):
        pair: list = [None, None]
        for side in ([0, 1] if rep % 2 == 0 else [1, 0]):
            pair[side] = timed((ours, raw)[side], before)
        times.append((pair[0], pair[1]))
    return times


def summary(name: str, page_nbytes: int, op: str, nbytes: int, times: list[tuple[tuple, tuple]]) -> tuple:
    """(backend, page size, op, raw GB/s, tierkv GB/s (medians), wall ratio min, median, CPU ratio median).

    The CPU ratio (raw CPU seconds / tierkv's, this process only) is the extra work, which a loaded
    machine cannot hide in a spare core."""
    ratios = [raw[0] / ours[0] for ours, raw in times]
    cpu_ratio = float(np.median([raw[1] / max(ours[1], 1e-9) for ours, raw in times]))
    return (name, page_nbytes, op, nbytes / float(np.median([r[0] for _, r in times])) / 1e9,
            nbytes / float(np.median([o[0] for o, _ in times])) / 1e9, min(ratios), float(np.median(ratios)),
            cpu_ratio)


def run_case(case: Case, keys, pages, targets, repeats: int) -> list[tuple]:
    nbytes = len(pages) * pages[0].numel()
    store = case.store
    ours_set = case.ours_set or (lambda: store.batch_set(keys, pages))
    set_times = interleaved(ours_set, case.raw_set, repeats, case.reset)
    case.reset()
    if not all(ours_set()):
        raise RuntimeError(f"{case.name}: writes failed ({store.stats.errors} errors)")
    case.raw_set()
    ours_get = case.ours_get or (lambda: store.batch_get(keys, targets))
    get_times = interleaved(ours_get, case.raw_get, repeats, case.before_get)
    found = ours_get()
    got = case.got_pages() if case.got_pages is not None else targets
    if not all(found) or not all(torch.equal(t, p) for t, p in zip(got, pages)):
        raise RuntimeError(f"{case.name}: read-back mismatch (found {sum(found)}/{len(found)})")
    return [summary(case.name, pages[0].numel(), case.set_label, nbytes, set_times),
            summary(case.name, pages[0].numel(), "get", nbytes, get_times)]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def memory_rss_child(page_nbytes: int, num_pages: int) -> None:
    """In a fresh process: RSS growth of a memory store holding ``num_pages`` pages, over their bytes."""
    from tierkv.storage.memory import MemoryStore
    ns = HashNamespace(model="rss")
    keys = page_hashes(list(range(num_pages)), 1, None, ns)
    source = torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8)
    store = MemoryStore(ns.name(), page_nbytes)
    before = rss_bytes()
    for start in range(0, num_pages, 8):  # as backups write: a few pages per call
        store.batch_set(keys[start:start + 8], [source] * len(keys[start:start + 8]))
    print(f"{(rss_bytes() - before) / (num_pages * page_nbytes):.4f}")


def memory_rss_ratio(page_nbytes: int, num_pages: int) -> float:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", str(page_nbytes),
                          str(num_pages)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


DIGESTS: dict[str, Callable[[], object]] = {
    "xxh3-64": xxhash.xxh3_64,
    "hmac-sha256": lambda: hmac.new(b"k" * 32, digestmod=hashlib.sha256),
    "blake2b-keyed": lambda: hashlib.blake2b(key=b"k" * 32, digest_size=16),
}


def digest_rows(pages, repeats: int) -> list[tuple[str, float, float]]:
    """(digest, GB/s, fraction of xxh3's speed): every page fed in chunks, digests run in turns."""
    views = [memoryview(p.numpy()) for p in pages]

    def run(make) -> None:
        for view in views:
            state = make()
            for start in range(0, len(view), CHUNK_NBYTES):
                state.update(view[start:start + CHUNK_NBYTES])
            state.digest()
    best = dict.fromkeys(DIGESTS, float("inf"))
    for rep in range(repeats):
        names = list(DIGESTS) if rep % 2 == 0 else list(DIGESTS)[::-1]
        for name in names:
            best[name] = min(best[name], best_seconds(lambda name=name: run(DIGESTS[name]), 1))
    nbytes = sum(len(v) for v in views)
    return [(name, nbytes / best[name] / 1e9, best["xxh3-64"] / best[name]) for name in DIGESTS]


def cold_hash_gbps(pages, repeats: int) -> float:
    """GB/s of xxh3 over every page of a batch in turn (more than the caches hold: a pass over memory)."""
    views = [memoryview(p.numpy()) for p in pages]
    if native.pageio is not None:
        seconds = best_seconds(lambda: native.pageio.xxh3_many(views), repeats)
    else:
        seconds = best_seconds(lambda: [xxhash.xxh3_64_intdigest(v) for v in views], repeats)
    return sum(len(v) for v in views) / seconds / 1e9


TARGETS = {"file": 0.9, "redis": 0.9, "mooncake": 0.9}  # issue 27 target 6 (issue 16 had asked 0.8 of Mooncake)


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def bench_page_size(page_nbytes: int, args) -> list[tuple]:
    num_pages = max(2, (args.batch_mib << 20) // page_nbytes)
    ns = HashNamespace(model="llama-3-8b", kv_dtype="bfloat16", kv_shape=(2, 32, 8, 128))
    keys = page_hashes(list(range(num_pages)), 1, None, ns)
    gen = torch.Generator().manual_seed(0)
    l2_copy = L2Copy(page_nbytes, num_pages, gen) if args.l2_copy else None
    pages = (l2_copy.raw_pages if l2_copy is not None else
             [torch.randint(0, 256, (page_nbytes,), dtype=torch.uint8, generator=gen) for _ in keys])
    targets = [torch.ones(page_nbytes, dtype=torch.uint8) for _ in keys]  # touched up front
    print(f"{size_label(page_nbytes)} pages: {num_pages} per batch, {args.repeats} interleaved repeats; "
          f"xxh3 over the batch, one thread: {cold_hash_gbps(pages, args.repeats):.2f} GB/s (the verification "
          "pass; a backend moving R GB/s that cannot hash inside its copy is bounded by 1 / (1 + R / this))")
    if args.digests:
        print(f"{'digest':<14} {'GB/s':>6} {'vs xxh3':>8}")
        for name, gbps, ratio in digest_rows(pages, args.repeats):
            print(f"{name:<14} {gbps:>6.2f} {ratio:>8.3f}")
    rows = []
    for name in args.backends.split(","):
        try:
            case = CASES[name](ns.name(), page_nbytes, keys, pages, targets, args)
        except Exception as err:  # noqa: BLE001 (a missing server skips the row, the table still prints)
            print(f"{name}: skipped ({type(err).__name__}: {err})")
            continue
        try:
            if l2_copy is not None:
                l2_copy.attach(case, keys)
            rows += run_case(case, keys, pages, targets, args.repeats)
        except RuntimeError as err:
            print(f"{name}: FAILED ({err})")
        finally:
            case.reset()
            case.cleanup()
    if l2_copy is not None:
        l2_copy.close()
    return rows


def print_rows(rows: list[tuple]) -> None:
    print(f"{'backend':<9} {'page':>7} {'op':<5} {'raw GB/s':>9} {'tierkv GB/s':>11} "
          f"{'ratio min':>9} {'median':>7} {'cpu ratio':>9} {'target':>6}")
    for name, page_nbytes, op, raw, ours, ratio_min, ratio_median, cpu_ratio in rows:
        target = TARGETS.get(name)
        flag = "" if target is None else f"{target:>6.2f}" + ("" if ratio_median >= target else "  below")
        print(f"{name:<9} {size_label(page_nbytes):>7} {op:<5} {raw:>9.2f} {ours:>11.2f} {ratio_min:>9.2f} "
              f"{ratio_median:>7.2f} {cpu_ratio:>9.2f} {flag}")


def start_spinners(num_cores: int) -> None:
    """Processes that spin for the whole run (ended at exit): the machine of a loaded server, where tierkv's
    extra work cannot hide in a spare core."""
    for _ in range(num_cores):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        atexit.register(spinner.kill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="131072,8388608", help="page sizes in bytes, comma-separated")
    parser.add_argument("--batch-mib", type=int, default=128, help="MiB per batch (pages = this / page size)")
    parser.add_argument("--backends", default="memory,file,redis,mooncake")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-pages", type=int, default=8, help="redis pages per pipeline round trip")
    parser.add_argument("--fsync", action="store_true", help="fsync every page (both sides)")
    parser.add_argument("--dir", default=None, help="parent directory for the file backend")
    parser.add_argument("--cold", action="store_true",
                        help="file: drop both sides' pages from the page cache before each read run")
    parser.add_argument("--page-key", default=None, help="authenticate pages with this secret (a MAC)")
    parser.add_argument("--digests", action="store_true", help="also a table of the digests alone")
    parser.add_argument("--l2-copy", action="store_true",
                        help="sets start with the L1 -> L2 copy on both sides (tierkv's hashes where the store takes "
                             "digests)")
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="keep this many cores busy with spinning processes while timing (as a loaded server)")
    parser.add_argument("--rss-pages", type=int, default=1 << 30, help="bytes the RSS check stores per size")
    parser.add_argument("--rss-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        memory_rss_child(*args.rss_child)
        return
    page_sizes = [int(size) for size in args.page_sizes.split(",")]
    start_spinners(args.busy_cores)
    print(f"busy cores {args.busy_cores}, fsync={args.fsync}, cold={args.cold}, page_key={bool(args.page_key)}, "
          f"l2_copy={args.l2_copy}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; tierkv moves a Mooncake batch on "
          f"up to {mooncake_store.IO_THREADS} threads and a file batch on the calling one, each page hashed by "
          "the thread that moves it; raw sides use one")
    rows = []
    for size in page_sizes:
        new_rows = bench_page_size(size, args)
        print_rows(new_rows)  # as they come: a later crash keeps them
        rows += new_rows
    print("all page sizes:")
    print_rows(rows)
    if "memory" in args.backends.split(","):
        print(f"{'memory store':<12} {'page':>7} {'RSS / bytes stored':>19} {'target':>6}")
        for size in page_sizes:
            ratio = memory_rss_ratio(size, max(8, args.rss_pages // size))
            print(f"{'':<12} {size_label(size):>7} {ratio:>19.3f} {1.2:>6.2f}" + ("" if ratio <= 1.2 else "  above"))


if __name__ == "__main__":
    main()
