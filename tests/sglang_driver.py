"""Runs in the SGLang venv (tests/test_sglang_backend.py starts it): tierkv's HiCache storage backend driven by
SGLang's own parts on CPU: its device and host KV pools, its backend factory (``dynamic``), and its cache
controller's storage calls (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``, with the get/set
functions that ``attach_storage_backend`` picks). The controller object is made without its ``__init__``
(that needs CUDA streams and process groups); every storage call below is SGLang's code.

Usage: python tests/sglang_driver.py '<json: {"dir": path, "redis" | "redis_cluster" | "mooncake": null or
{"storage_backend": url, ...client keys}}>'
Prints one line ``RESULT <json>``: facts per check (hits, pages read, pages bit-exact) for the test to judge.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import tempfile

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE_SIZE = 4
NUM_PAGES = 6
BACKEND = {"backend_name": "tierkv", "module_path": "tierkv.integrations.sglang", "class_name": "TierkvStorage"}
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KEY_A, KEY_B = "the-real-page-key-0123456789", "an-attacker-key-9876543210"


def host_pool(kind: str, layout: str, page_size: int = PAGE_SIZE, num_layers: int = 3, num_heads: int = 2,
              head_dim: int = 8, num_tokens: int = 64):
    """A real SGLang host pool on CPU (not pinned: pinning needs CUDA) behind a real device pool of
    ``num_tokens`` (the host pool holds twice that). MLA rows are ``2 * head_dim + head_dim`` wide."""
    common = dict(size=num_tokens, page_size=page_size, dtype=torch.bfloat16, layer_num=num_layers, device="cpu",
                  enable_memory_saver=False)
    if kind == "mha":
        device = MHATokenToKVPool(head_num=num_heads, head_dim=head_dim, **common)
        cls, info, kwargs = _mha_host_inputs(device)
        return cls(info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
                   pin_memory=False, **kwargs)
    device = MLATokenToKVPool(kv_lora_rank=2 * head_dim, qk_rope_head_dim=head_dim, **common)
    return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0,
                                host_size=0, page_size=page_size, layout=layout, pin_memory=False,
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer, target_layer_num=device.layer_num,
                                override_kv_cache_dim=device.kv_cache_dim)


def controller(pool, extra: dict, tp_rank: int = 0, tp_size: int = 1, backend: str = "dynamic"):
    """SGLang's factory makes the backend (``dynamic``: tierkv's; ``file``: SGLang's own); the controller gets
    it as ``attach_storage_backend`` wires it: zero-copy get/set only for ``dynamic`` with ``interface_v1``."""
    extra_config = {**BACKEND, **extra} if backend == "dynamic" else dict(extra)
    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=isinstance(pool, MLATokenToKVPoolHost),
                                  enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first",
                                  model_name="org/tiny-model", extra_config=extra_config)
    storage = StorageBackendFactory.create_backend(backend, config, pool)
    storage.register_mem_pool_host(pool)
    ctrl = HiCacheController.__new__(HiCacheController)
    ctrl.storage_backend, ctrl.storage_host_pool, ctrl.mem_pool_host = storage, pool, pool
    ctrl.page_size, ctrl.storage_config, ctrl.prefetch_sync_queue = pool.page_size, config, queue.Queue()
    ctrl.page_get_func, ctrl.page_set_func = ctrl._generic_page_get, ctrl._generic_page_set
    if backend == "dynamic" and extra_config.get("interface_v1", 0):
        ctrl.page_get_func, ctrl.page_set_func = ctrl._page_get_zero_copy, ctrl._page_set_zero_copy
    _LIVE.append(ctrl)
    return ctrl


# Every controller stays alive until the driver exits. A Mooncake client that the garbage collector closes
# unmounts its segment, and the master may have put another client's pages there: those pages would
# vanish mid-check (a lost hit, not wrong KV, but the checks expect every page back).
_LIVE: list = []


def tokens(seed: int, num_pages: int = NUM_PAGES, page_size: int = PAGE_SIZE) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (num_pages * page_size,), generator=gen).tolist()


def fill(pool, num_tokens: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Host slots for ``num_tokens`` holding random KV: (their indices, each page's flat data)."""
    indices = pool.alloc(num_tokens)
    gen = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(0, num_tokens, pool.page_size):
        page = torch.randn(pool.get_dummy_flat_data_page().numel(), generator=gen).to(pool.dtype)
        pool.set_from_flat_data_page(int(indices[i]), page)
        pages.append(page)
    return indices, pages


def backup(ctrl, indices: torch.Tensor, token_ids: list[int]) -> int:
    """SGLang's backup of the host slots ``indices`` holding ``token_ids``; the tokens it stored."""
    hashes = get_storage_hash_str(token_ids, None, ctrl.page_size)
    op = StorageOperation(indices, token_ids, hash_value=hashes, prefix_keys=[])
    ctrl._page_backup(op)
    return op.completed_tokens


def write(ctrl, token_ids: list[int], seed: int) -> tuple[int, list[torch.Tensor]]:
    """Fill host pages with random KV, back them up through SGLang; (tokens backed up, the flat pages)."""
    indices, pages = fill(ctrl.storage_host_pool, len(token_ids), seed)
    backed_up = backup(ctrl, indices, token_ids)
    ctrl.storage_host_pool.free(indices)
    return backed_up, pages


def prefetch(ctrl, token_ids: list[int], indices: torch.Tensor) -> tuple[int, int]:
    """SGLang's hit query, then its prefetch transfer of the hit into host slots ``indices`` (as many as the
    tokens); (hit tokens, pages read)."""
    op = PrefetchOperation("req", token_ids, prefix_keys=[])
    hashes, hit_tokens = ctrl._storage_hit_query(op)
    if not hashes:
        return hit_tokens, 0
    op.hash_value, op.host_indices = hashes, indices[:len(hashes) * ctrl.page_size]
    return hit_tokens, ctrl._page_transfer(op)


def read(ctrl, token_ids: list[int]) -> tuple[int, list[torch.Tensor]]:
    """:func:`prefetch` into fresh host slots; (hit tokens, the pages read)."""
    pool, page_size = ctrl.storage_host_pool, ctrl.page_size
    indices = pool.alloc(len(token_ids))
    for i in range(0, len(indices), page_size):  # poison: a page the transfer skipped cannot pass as read
        pool.set_from_flat_data_page(int(indices[i]), torch.full_like(pool.get_dummy_flat_data_page(), -7.0))
    hit_tokens, done = prefetch(ctrl, token_ids, indices)
    pages = [pool.get_data_page(int(indices[i * page_size]), flat=True).clone() for i in range(done)]
    pool.free(indices)
    return hit_tokens, pages


def exact(expected: list[torch.Tensor], got: list[torch.Tensor]) -> int:
    """How many pages of ``got`` equal ``expected``'s bit for bit, from the first."""
    count = 0
    for want, have in zip(expected, got):
        if not torch.equal(want.view(torch.int16), have.view(torch.int16)):
            break
        count += 1
    return count


def roundtrip(kind: str, layout: str, extra: dict, read_extra: dict | None = None, seed: int = 1) -> dict:
    """Write through one backend, read through another on a fresh pool (as after a restart)."""
    writer = controller(host_pool(kind, layout), extra)
    token_ids = tokens(seed)
    backed_up, pages = write(writer, token_ids, seed)
    reader = controller(host_pool(kind, layout), read_extra if read_extra is not None else extra)
    hit_tokens, got = read(reader, token_ids)
    return {"backed_up": backed_up // PAGE_SIZE, "hit": hit_tokens // PAGE_SIZE, "read": len(got),
            "exact": exact(pages, got), "zero_copy": reader.storage_backend.geometry.zero_copy,
            "elements": reader.storage_backend.geometry.elements_per_page}


def file_extra(root: str, **more) -> dict:
    return {"interface_v1": 1, "storage_backend": f"file://{root}", **more}


def check_layouts(root: str) -> dict:
    out = {}
    for kind in ("mha", "mla"):
        for layout in LAYOUTS:
            for v1 in (1, 0):
                extra = {**file_extra(os.path.join(root, f"{kind}-{layout}-{v1}")), "interface_v1": v1}
                out[f"{kind}/{layout}/v1={v1}"] = roundtrip(kind, layout, extra)
    return out


def check_interfaces_agree(root: str) -> dict:
    """Pages written by one interface read back through the other, for a zero-copy and a staged layout."""
    out = {}
    for layout in ("page_first", "layer_first"):
        for kind in ("mha", "mla"):
            v1 = file_extra(os.path.join(root, f"x-{kind}-{layout}"))
            out[f"{kind}/{layout}/v1->generic"] = roundtrip(kind, layout, v1, {**v1, "interface_v1": 0}, seed=2)
            out[f"{kind}/{layout}/generic->v1"] = roundtrip(kind, layout, {**v1, "interface_v1": 0}, v1, seed=3)
    return out


def check_prefix_runs(root: str) -> dict:
    ctrl = controller(host_pool("mha", "page_first"), file_extra(root))
    stored = tokens(4)
    write(ctrl, stored, 4)
    backend = ctrl.storage_backend
    keys = get_storage_hash_str(stored, None, PAGE_SIZE)
    diverged = stored[:3 * PAGE_SIZE] + tokens(5, NUM_PAGES - 3)
    return {
        "longer": read(ctrl, stored + tokens(6, 3))[0] // PAGE_SIZE,
        "diverged_at_3": read(ctrl, diverged)[0] // PAGE_SIZE,
        "unrelated": read(ctrl, tokens(7))[0] // PAGE_SIZE,
        "hole_at_2": backend.batch_exists(keys[:2] + ["ab" * 32] + keys[3:]),
        "with_prefix_keys": backend.batch_exists(keys[2:], HiCacheStorageExtraInfo(prefix_keys=keys[:2])),
        "empty": backend.batch_exists([]),
    }


def _page_extent(ctrl, key: str, element: int) -> tuple[str, int, int]:
    """(pack file, payload offset, header offset) of one element of page ``key``."""
    return ctrl.storage_backend.store.page_extent(f"{key}{element:02x}")


def check_corrupt(root: str) -> dict:
    """A flipped byte (page 2's V element), a broken header (page 4): misses from there, nothing wrong read."""
    out = {}
    for layout in ("page_first", "layer_first"):
        ctrl = controller(host_pool("mha", layout), file_extra(os.path.join(root, layout)))
        stored = tokens(8)
        _, pages = write(ctrl, stored, 8)
        keys = get_storage_hash_str(stored, None, PAGE_SIZE)
        elements = ctrl.storage_backend.geometry.elements_per_page
        pack, payload_at, _ = _page_extent(ctrl, keys[2], elements - 1)
        with open(pack, "r+b") as f:
            f.seek(payload_at + 5)
            byte = f.read(1)
            f.seek(payload_at + 5)
            f.write(bytes([byte[0] ^ 0x10]))
        pack, _, header_at = _page_extent(ctrl, keys[4], 0)  # the same pack: the backup was one batch
        with open(pack, "r+b") as f:
            f.seek(header_at)
            f.write(b"XXXX")  # page 4's magic
        hit, got = read(ctrl, stored)
        hit_after, _ = read(ctrl, stored)
        out[layout] = {"hit": hit // PAGE_SIZE, "read": len(got), "exact": exact(pages, got),
                       "hit_after": hit_after // PAGE_SIZE,
                       "corrupt_counted": ctrl.storage_backend.store.stats.corrupt_pages}
    return out


def check_forged(root: str) -> dict:
    """Pages written with another page key, or with none, are misses for a reader holding the key."""
    out = {}
    for name, writer_key in (("wrong_key", KEY_B), ("no_key", None), ("same_key", KEY_A)):
        path = os.path.join(root, name)
        writer_extra = file_extra(path, **({"page_key": writer_key} if writer_key else {}))
        out[name] = roundtrip("mha", "page_first", writer_extra, file_extra(path, page_key=KEY_A), seed=9)
    return out


def check_tp_naming(root: str) -> dict:
    """MHA: each TP rank its own pages; MLA: one copy that every rank reads."""
    out = {}
    for kind in ("mha", "mla"):
        extra = file_extra(os.path.join(root, kind))
        rank0 = controller(host_pool(kind, "page_first"), extra, tp_rank=0, tp_size=2)
        rank1 = controller(host_pool(kind, "page_first"), extra, tp_rank=1, tp_size=2)
        shared = tokens(10)
        _, pages0 = write(rank0, shared, 10)
        hit1, got1 = read(rank1, shared)
        out[kind] = {"rank1_hit": hit1 // PAGE_SIZE, "rank1_exact_vs_rank0": exact(pages0, got1),
                     "rank0_namespace": rank0.storage_backend.store.namespace,
                     "rank1_namespace": rank1.storage_backend.store.namespace}
        if kind == "mha":
            _, pages1 = write(rank1, shared, 11)
            out[kind]["rank1_own_exact"] = exact(pages1, read(rank1, shared)[1])
            out[kind]["rank0_own_exact"] = exact(pages0, read(rank0, shared)[1])
    return out


def check_layout_isolation(root: str) -> dict:
    extra = file_extra(root)
    writer = controller(host_pool("mha", "page_first"), extra)
    stored = tokens(12)
    write(writer, stored, 12)
    return {layout: read(controller(host_pool("mha", layout), extra), stored)[0] // PAGE_SIZE
            for layout in LAYOUTS}


def check_bounded(root: str) -> dict:
    """A file store bounded to 3 pages' elements keeps at most that; what it serves is still exact."""
    probe = controller(host_pool("mha", "page_first"), file_extra(os.path.join(root, "probe")))
    blob_nbytes = probe.storage_backend.geometry.element_nbytes + 48
    max_bytes = 3 * 2 * blob_nbytes
    ctrl = controller(host_pool("mha", "page_first"), file_extra(os.path.join(root, "bounded"), max_bytes=max_bytes))
    stored = tokens(13)
    _, pages = write(ctrl, stored, 13)
    hit, got = read(ctrl, stored[:2 * PAGE_SIZE])  # the first pages were written first: the LRU victims
    stored_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(root, "bounded"))
                       for f in files if f.endswith(".pack"))
    return {"max_bytes": max_bytes, "stored_bytes": stored_bytes, "hit": hit // PAGE_SIZE, "read": len(got),
            "exact": exact(pages, got)}


def check_config_errors(root: str) -> dict:
    out = {}
    cases = {"missing_backend": {"interface_v1": 1},
             "unknown_key": file_extra(root, max_byte=10),
             "bad_type": file_extra(root, max_bytes="10GB"),
             "bad_spec": {"storage_backend": "s3://bucket"}}
    for name, extra in cases.items():
        try:
            controller(host_pool("mha", "page_first"), extra)
            out[name] = None
        except (ValueError, TypeError) as err:
            out[name] = str(err)
    return out


def check_secret_warning(root: str) -> dict:
    """A page key typed on the command line gets a warning naming the key's name, never its value; a config
    without ``interface_v1`` gets a hint."""
    from tierkv.integrations import sglang as backend_module

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    backend_module.log.addHandler(handler)
    backend_module.log.setLevel(logging.WARNING)  # main() quiets the root logger to errors
    out = {}
    try:
        for name, argv, v1 in (("inline", ["launch_server", json.dumps({"page_key": KEY_A})], 1),
                               ("from_file", ["launch_server", "@/etc/tierkv/sglang-l3.json"], 1),
                               ("copying", ["launch_server", "@/etc/tierkv/sglang-l3.json"], 0)):
            records.clear()
            old_argv, sys.argv = sys.argv, argv
            try:
                controller(host_pool("mha", "page_first"),
                           file_extra(os.path.join(root, name), page_key=KEY_A, interface_v1=v1))
            finally:
                sys.argv = old_argv
            out[name] = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
    finally:
        backend_module.log.removeHandler(handler)
        backend_module.log.setLevel(logging.NOTSET)
    return out


def check_remote(options: dict | None, seed: int) -> dict | None:
    """Round trips through a remote store (``options``: its spec and client keys), MHA and MLA."""
    if not options:
        return None
    extra = {"interface_v1": 1, "page_key": KEY_A, **options}
    return {kind: roundtrip(kind, "page_first", extra, seed=seed + i) for i, kind in enumerate(("mha", "mla"))}


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    args = json.loads(sys.argv[1])
    root = args.get("dir") or tempfile.mkdtemp(prefix="sglang-l3-")
    checks = {"layouts": check_layouts, "interfaces_agree": check_interfaces_agree, "prefix_runs": check_prefix_runs,
              "corrupt": check_corrupt, "forged": check_forged, "tp_naming": check_tp_naming,
              "layout_isolation": check_layout_isolation, "bounded": check_bounded,
              "config_errors": check_config_errors, "secret_warning": check_secret_warning}
    result = {name: check(os.path.join(root, name)) for name, check in checks.items()}
    for seed, name in enumerate(("redis", "redis_cluster", "mooncake")):
        result[name] = check_remote(args.get(name), 20 + 10 * seed)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
