"""L3 under tensor parallelism with 2 gloo ranks: HiCache's agreement rules for prefetch and MLA backup.

- a rank whose reads failed stops the prefetch on every rank (MAX of "terminated");
- the timeout policy stops a prefetch once its budget has passed on every rank (MIN of "timed out");
- ranks agree (MIN) on how many leading pages every rank's L3 holds before reading, and read only those;
- MLA KV (identical on every rank) is stored once, written by rank 0, and read by every rank;
- a namespace given as a string (the model name) still names each rank's own shard of the heads.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierkv.cache.config import CacheConfig
from tierkv.hashing import HashNamespace
from tierkv.cache.hicache import HiRadixCache
from tierkv.cache.l3.controller import open_storage
from tierkv.pools.kv import DeviceKVPool
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey
from tierkv.storage.factory import open_store
from tierkv.tp import TPGroup

from storage_util import FakeStore, compute_and_insert, drop_l1_l2, load_hit, random_tokens, storage_config

PS = 4
NUM_PAGES = 8
MHA = KVSpec(num_layers=2, kv_heads=4, head_dim=8, dtype=torch.float32)
MLA = KVSpec(num_layers=2, attention="mla", kv_lora_rank=12, rope_dim=4, dtype=torch.float32)
MAX_STEPS = 300  # ~3 s of steps: far below the 60 s prefetch budget the stop must not wait for


class CountingStore(FakeStore):
    """Counts pages read and written; ``visible_pages`` hides the tail from exists (a shorter L3);
    ``gate_after_gets`` blocks reads after that many batch_get calls until ``gate`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pages_read = self.pages_written = 0
        self.visible_pages: int | None = None
        self.gate_after_gets: int | None = None
        self.gate = threading.Event()
        self.num_gets = 0

    def batch_exists(self, keys: list[str]) -> int:
        found = super().batch_exists(keys)
        return found if self.visible_pages is None else min(found, self.visible_pages)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        self.num_gets += 1
        if self.gate_after_gets is not None and self.num_gets > self.gate_after_gets:
            self.gate.wait()
        self.pages_read += len(keys)
        return super().batch_get(keys, targets)

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        self.pages_written += len(keys)
        return super().batch_set(keys, values)


def _cache(spec: KVSpec, tp: TPGroup) -> HiRadixCache:
    shard = spec.shard(tp.rank, tp.world_size)
    config = CacheConfig(page_size=PS, host_layout="page_first", hicache_ratio=2.0)
    return HiRadixCache(DeviceKVPool(shard, 256, PS, "cpu"), config, tp=tp)


def _stored_cache(tp: TPGroup, key: RadixKey, **storage) -> tuple[HiRadixCache, CountingStore]:
    """A rank's cache whose own L3 holds ``key``'s KV and whose L1 and L2 are empty."""
    cache = _cache(MHA, tp)
    store = CountingStore("tp-ns", cache.host_pool.page_nbytes)
    namespace = HashNamespace.for_spec("tp-model", cache.device_pool.spec, "page_first", tp.rank, tp.world_size)
    cache.attach_storage(store, storage_config(prefetch_batch_pages=1, **storage), namespace)
    compute_and_insert(cache, key, seed=10 + tp.rank)
    drop_l1_l2(cache)
    return cache, store


def _run_prefetch(cache: HiRadixCache, key: RadixKey) -> int:
    """Start a prefetch and step until it may stop; the number of steps it took (MAX_STEPS: never)."""
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    for step in range(MAX_STEPS):
        cache.step()
        if cache.check_prefetch_progress("r"):  # agreed state only: every rank returns at the same step
            return step
        time.sleep(0.01)
    return MAX_STEPS


def _terminated_anywhere_stops_everywhere(tp: TPGroup) -> None:
    key = RadixKey(random_tokens(NUM_PAGES * PS, seed=1))
    cache, store = _stored_cache(tp, key, prefetch_stop_policy="wait_complete")
    if tp.rank == 0:  # reads fail at page 3 of 8
        store.corrupt = set(list(store.blobs)[3:])
    else:  # a slow rank: its third read hangs until the end of the test
        store.gate_after_gets = 2
    steps = _run_prefetch(cache, key)
    assert steps < MAX_STEPS, "a rank that terminated must stop the prefetch on every rank"
    hit = cache.match_prefix(key).host_hit_length
    assert hit == 2 * PS, hit  # the pages every rank has (rank 1 read 2, rank 0 had 3)
    store.gate.set()
    cache.flush()
    cache.check_integrity()
    tp.check_same_tree(cache.tree, include_slots=True)
    cache.close()


def _timeout_stops_when_every_rank_may(tp: TPGroup) -> None:
    key = RadixKey(random_tokens(NUM_PAGES * PS, seed=5))
    cache, store = _stored_cache(tp, key, prefetch_stop_policy="timeout", prefetch_timeout_base=600.0)
    store.gate_after_gets = 0  # every read hangs: only the budget can end the prefetch
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    prefetch = cache.storage.prefetches["r"]
    while not prefetch.granted.is_set():  # agreed state: every rank leaves this loop at the same step
        cache.step()
        time.sleep(0.01)
    if tp.rank == 0:
        prefetch.started_s -= 1000.0  # rank 0's budget has passed; rank 1's has not
    for _ in range(5):
        cache.step()
        assert not cache.check_prefetch_progress("r"), f"rank {tp.rank} stopped while rank 1 may not"
    if tp.rank == 1:
        prefetch.started_s -= 1000.0  # now every rank may stop
    cache.step()
    assert cache.check_prefetch_progress("r")
    store.gate.set()
    cache.flush()
    cache.check_integrity()
    tp.check_same_tree(cache.tree, include_slots=True)
    cache.close()


def _agree_on_hit_count_before_reading(tp: TPGroup) -> None:
    key = RadixKey(random_tokens(NUM_PAGES * PS, seed=2))
    cache, store = _stored_cache(tp, key, prefetch_stop_policy="wait_complete")
    if tp.rank == 0:
        store.visible_pages = 3  # this rank's L3 holds 3 of 8 pages
    steps = _run_prefetch(cache, key)
    assert steps < MAX_STEPS
    assert store.pages_read == 3, f"rank {tp.rank} read {store.pages_read} pages; only 3 are on every rank"
    assert cache.match_prefix(key).host_hit_length == 3 * PS
    cache.check_integrity()
    tp.check_same_tree(cache.tree, include_slots=True)
    cache.close()


def _mla_stored_once(tp: TPGroup, l3_dir: str) -> None:
    cache = _cache(MLA, tp)
    namespace = HashNamespace.for_spec("tp-mla", cache.device_pool.spec, "page_first", tp.rank, tp.world_size)
    assert "tp=0of1" in namespace.name()  # one name on every rank
    inner = open_store(f"file:{l3_dir}", namespace.name(), cache.host_pool.page_nbytes)
    store = _Counting(inner)
    cache.attach_storage(store, storage_config(prefetch_stop_policy="wait_complete"), namespace)
    key = RadixKey(random_tokens(NUM_PAGES * PS, seed=3))
    kv = compute_and_insert(cache, key, seed=30)  # MLA: the same latent KV on every rank
    drop_l1_l2(cache)
    for _ in range(50):  # the backup (rank 0 only) is retired once agreed
        cache.step()
    assert store.pages_written == (NUM_PAGES if tp.rank == 0 else 0), store.pages_written
    steps = _run_prefetch(cache, key)
    assert steps < MAX_STEPS
    assert torch.equal(load_hit(cache, key), kv), f"rank {tp.rank} read wrong KV"
    cache.check_integrity()
    tp.check_same_tree(cache.tree, include_slots=True)
    cache.close()


def _string_namespace_is_per_rank(tp: TPGroup, l3_dir: str) -> None:
    """Both ranks store the same prompt (their own head shard) in one L3 under a string namespace; each
    must read back its own shard, never the other rank's."""
    cache = _cache(MHA, tp)
    extra = json.dumps({"prefetch_threshold": 0, "prefetch_stop_policy": "wait_complete"})
    open_storage(cache, f"file:{l3_dir}/by-name", extra, "my-model")
    key = RadixKey(random_tokens(NUM_PAGES * PS, seed=4))
    kv = compute_and_insert(cache, key, seed=40 + tp.rank)  # each rank's own heads
    drop_l1_l2(cache)
    dist.barrier()  # both ranks' backups are in L3 before either reads
    steps = _run_prefetch(cache, key)
    assert steps < MAX_STEPS
    assert torch.equal(load_hit(cache, key), kv), f"rank {tp.rank} read another rank's head shard"
    assert f"tp={tp.rank}of2" in cache.storage.namespace.name()
    cache.check_integrity()
    cache.close()


class _Counting:
    """Counts pages written through to a real store (the file backend under test)."""

    def __init__(self, inner) -> None:
        self.inner, self.pages_written = inner, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        self.pages_written += len(keys)
        return self.inner.batch_set(keys, values)


def _rank_main(rank: int, world_size: int, port: int, l3_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        tp = TPGroup.from_default_group()
        _terminated_anywhere_stops_everywhere(tp)
        _timeout_stops_when_every_rank_may(tp)
        _agree_on_hit_count_before_reading(tp)
        _mla_stored_once(tp, l3_dir)
        _string_namespace_is_per_rank(tp, l3_dir)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_follow_hicache_storage_agreement(tmp_path: Path) -> None:
    mp.set_forkserver_preload(["torch", "torch.distributed", "tierkv.cache.hicache", "tierkv.tp"])
    mp.start_processes(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="forkserver")


@pytest.mark.parametrize("tp_rank, tp_size", [(0, 1), (0, 2), (1, 3)])
def test_a_namespace_naming_another_tp_shard_is_refused(tp_rank: int, tp_size: int) -> None:
    """Rank 1 of 2 given rank 0's (or no rank's) namespace would read rank 0's heads as its own."""
    cache = _cache(MHA, TPGroup(1, 2))
    namespace = HashNamespace.for_spec("m", cache.device_pool.spec, "page_first", tp_rank, tp_size)
    store = CountingStore(namespace.name(), cache.host_pool.page_nbytes)
    with pytest.raises(ValueError, match=f"names TP shard {tp_rank}of{tp_size} but this cache is TP rank 1 of 2"):
        cache.attach_storage(store, storage_config(), namespace)
    assert cache.storage is None
    own = HashNamespace.for_spec("m", cache.device_pool.spec, "page_first", 1, 2)
    cache.attach_storage(store, storage_config(), own)  # its own shard is accepted
    assert cache.storage.namespace == own
    cache.storage.close()  # a lone rank: the cache's own close would run a collective


def test_an_mla_namespace_must_be_rank_less() -> None:
    """MLA pages are one copy for every rank: a namespace naming one rank would never be written."""
    cache = _cache(MLA, TPGroup(1, 2))
    ranked = HashNamespace(model="m", tp_rank=1, tp_size=2)
    store = CountingStore(ranked.name(), cache.host_pool.page_nbytes)
    with pytest.raises(ValueError, match="whose mla pages are 0of1"):
        cache.attach_storage(store, storage_config(), ranked)
    cache.attach_storage(store, storage_config(), "m")
    assert "tp=0of1" in cache.storage.namespace.name()
    cache.storage.close()
