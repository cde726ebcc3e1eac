"""TP agreement: ranks with different background delays must keep identical trees after every step."""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierkv.cache.config import CacheConfig
from tierkv.hashing import HashNamespace
from tierkv.cache.hicache import HiRadixCache, MatchResult, PendingLoad
from tierkv.pools.kv import DeviceKVPool
from tierkv.pools.spec import KVSpec
from tierkv.radix import RadixKey, TreeNode
from tierkv.storage.base import PageStore
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import open_store
from tierkv.tp import TPGroup, tree_digest

FULL_SPEC = KVSpec(num_layers=2, kv_heads=4, head_dim=8, dtype=torch.float32)
VOCAB = 500
DEVICE_TOKENS = 128
COPY_DELAYS_S = (0.0, 0.0, 0.0005, 0.002, 0.004)
STORE_DELAYS_S = (0.0, 0.0, 0.001, 0.003)


# ---- single process ----------------------------------------------------------------------------------
def test_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank 2 of world_size 2"):
        TPGroup(2, 2)
    with pytest.raises(ValueError, match="world_size 0"):
        TPGroup(0, 0)


def test_from_default_group_without_distributed_is_single() -> None:
    assert not dist.is_initialized()
    tp = TPGroup.from_default_group()
    assert (tp.rank, tp.world_size) == (0, 1)
    with pytest.raises(ValueError, match="not initialised"):
        TPGroup.from_group()


def test_single_rank_runs_no_collective(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective ran with tp_size == 1")

    for name in ("all_reduce", "all_gather_object", "all_gather", "broadcast"):
        monkeypatch.setattr(dist, name, forbidden)
    tp = TPGroup.single()
    assert tp.agree([3, 1], [0, 2]) == ([3, 1], [0, 2])
    assert tp.gather_digests("d") == ["d"]
    run = _Workload(0, 1, tp, seed=5, page_size=1, write_policy="write_through",
                    storage=dict(prefetch_threshold=8), store_dir=str(tmp_path))
    for step in range(40):
        run.step(step)
    run.finish()
    assert tp.collectives == 0
    assert run.cache.storage.stats.backup_started > 0


def _same_workload_digest(seed: int) -> tuple[str, str]:
    run = _Workload(0, 1, TPGroup.single(), seed=seed, page_size=2, write_policy="write_through")
    for step in range(30):
        run.step(step)
    digests = tree_digest(run.cache.tree), tree_digest(run.cache.tree, include_slots=True)
    run.finish()
    return digests


def test_digest_ignores_node_ids_but_not_state() -> None:
    first, second = _same_workload_digest(11), _same_workload_digest(11)
    assert first == second  # node ids differ between the two runs (one global counter)
    run = _Workload(0, 1, TPGroup.single(), seed=11, page_size=2, write_policy="write_through")
    for step in range(30):
        run.step(step)
    tree = run.cache.tree
    node = next(n for n in tree.nodes() if n.device_value is not None)
    before = tree_digest(tree)
    for mutate, undo in [(lambda: setattr(node, "hit_count", node.hit_count + 1),
                          lambda: setattr(node, "hit_count", node.hit_count - 1)),
                         (lambda: tree.inc_lock_ref(node), lambda: tree.dec_lock_ref(node)),
                         (lambda: tree.inc_host_ref(node), lambda: tree.dec_host_ref(node)),
                         (lambda: setattr(node, "last_access_time", node.last_access_time + 1),
                          lambda: setattr(node, "last_access_time", node.last_access_time - 1))]:
        mutate()
        assert tree_digest(tree) != before
        undo()
        assert tree_digest(tree) == before
    slots = node.device_value
    node.device_value = slots.flip(0)
    assert tree_digest(tree) == before
    assert tree_digest(tree, include_slots=True) != tree_digest(tree, include_slots=False)
    node.device_value = slots
    run.finish()


# ---- the workload every rank runs ------------------------------------------------------------------------
def expected_kv(tokens: list[int], first_pos: int, rank: int, heads: int) -> torch.Tensor:
    """Deterministic KV of ``tokens`` at positions from ``first_pos`` for this rank's heads."""
    tok = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(first_pos, first_pos + len(tokens), dtype=torch.float32)
    base = (tok + pos / 1024)[None, None, :, None, None]
    kv = torch.arange(2, dtype=torch.float32)[:, None, None, None, None] * 7000
    layer = torch.arange(FULL_SPEC.num_layers, dtype=torch.float32)[None, :, None, None, None] * 3000
    head = (rank * heads + torch.arange(heads, dtype=torch.float32))[None, None, None, :, None] * 1000
    dim = torch.arange(FULL_SPEC.head_dim, dtype=torch.float32)[None, None, None, None, :] / 16
    return base + kv + layer + head + dim


@dataclass
class _Request:
    key: RadixKey
    slots: torch.Tensor
    own: torch.Tensor
    last_node: TreeNode
    pending: PendingLoad | None
    finish_step: int


class DelayedStore(PageStore):
    """Forwards to ``inner`` after a random pause, so each rank's storage workers finish at other times."""

    name = "delayed"

    def __init__(self, inner: PageStore, delays_s: tuple[float, ...], seed: int) -> None:
        super().__init__(inner.namespace, inner.page_nbytes)
        self.inner, self.delays_s = inner, delays_s
        self._rng, self._lock = random.Random(seed), threading.Lock()  # two worker threads draw

    def _pause(self) -> None:
        with self._lock:
            delay_s = self._rng.choice(self.delays_s)
        time.sleep(delay_s)

    def batch_exists(self, keys: list[str]) -> int:
        self._pause()
        return self.inner.batch_exists(keys)

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        self._pause()
        return self.inner.batch_get(keys, targets)

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        self._pause()
        return self.inner.batch_set(keys, values)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()


class _Workload:
    """A seeded scheduler loop: requests share prefixes, may wait for an L3 prefetch, hold their locks
    a few steps, then insert. ``storage`` (StorageConfig fields) adds a file L3 under ``store_dir``."""

    def __init__(self, rank: int, world_size: int, tp: TPGroup, seed: int, page_size: int,
                 write_policy: str, host_layout: str = "layer_first", io_backend: str = "kernel",
                 eviction_policy: str = "lru", storage: dict | None = None, store_dir: str = "") -> None:
        self.rank, self.tp = rank, tp
        self.spec = FULL_SPEC.shard(rank, world_size)
        config = CacheConfig(page_size=page_size, write_policy=write_policy, host_layout=host_layout,
                             io_backend=io_backend, eviction_policy=eviction_policy, load_back_threshold=4,
                             hicache_ratio=3.0)
        self.cache = HiRadixCache(DeviceKVPool(self.spec, DEVICE_TOKENS, page_size, "cpu"), config, tp=tp)
        if storage is not None:
            namespace = HashNamespace.for_spec("tp-test", self.spec, self.cache.host_pool.layout, rank,
                                               world_size)
            inner = open_store(f"file:{store_dir}", namespace.name(), self.cache.host_pool.page_nbytes)
            store = DelayedStore(inner, STORE_DELAYS_S, seed=300 + rank)
            self.cache.attach_storage(store, StorageConfig(**storage), namespace)
        self.page_size = page_size
        self.wl = random.Random(seed)  # identical on every rank: the scheduler's decisions
        self.docs = [[self.wl.randrange(VOCAB) for _ in range(self.wl.randint(16, 80))] for _ in range(6)]
        self.running: list[_Request] = []
        self.waiting: list[tuple[str, RadixKey, int]] = []  # requests whose L3 prefetch runs
        self.num_requests = 0
        self.kv_checks = 0

    def step(self, step: int) -> None:
        """One scheduler step's decisions (the caller then runs ``cache.step()``)."""
        for waiting in list(self.waiting):
            request_id, key, ready_step = waiting
            if step < ready_step:  # its turn in the batch has not come yet
                continue
            if self.wl.random() < 0.05:  # the request was aborted
                self.cache.release_prefetch(request_id)
                self.waiting.remove(waiting)
            elif self.cache.check_prefetch_progress(request_id):
                self.waiting.remove(waiting)
                self._admit(key, self.cache.match_prefix(key), step)
        op = self.wl.random()
        if op < 0.6 and len(self.running) + len(self.waiting) < 4:
            self._start(step)
        elif op < 0.7:
            self.cache.evict(self.wl.randint(1, 48))
        elif op < 0.78:
            self.cache.evict_host(self.wl.randint(1, 48))
        for req in [r for r in self.running if r.finish_step <= step]:
            self._finish(req)

    def _start(self, step: int) -> None:
        doc = self.wl.choice(self.docs)
        tokens = doc[: self.wl.randint(len(doc) // 2, len(doc))]
        tokens += [self.wl.randrange(VOCAB) for _ in range(self.wl.randint(0, 24))]
        key = RadixKey(tokens, self.wl.choice([None, None, "tenant-b"]))
        m = self.cache.match_prefix(key)
        request_id = f"r{self.num_requests}"
        self.num_requests += 1
        if self.cache.prefetch_from_storage(request_id, m.last_host_node, key):
            self.waiting.append((request_id, key, step + self.wl.randint(1, 4)))
        else:
            self._admit(key, m, step)

    def _admit(self, key: RadixKey, m: MatchResult, step: int) -> None:
        tokens = list(key.token_ids)
        prefix, last, pending = m.device_indices, m.last_device_node, None
        if m.host_hit_length:
            loaded = self.cache.init_load_back(m.last_host_node)
            prefix, last, pending = loaded.device_indices, loaded.last_node, loaded.pending
        self.cache.inc_lock_ref(last)
        num_new = -(-(len(tokens) - len(prefix)) // self.page_size) * self.page_size
        own = self.cache.alloc_device(num_new)
        if own is None:
            self.cache.dec_lock_ref(last)
            return
        new_tokens = tokens[len(prefix):] + [0] * (num_new - (len(tokens) - len(prefix)))
        self.cache.device_pool.write_tokens(own, expected_kv(new_tokens, len(prefix), self.rank,
                                                             self.spec.kv_heads))
        finish = step + self.wl.randint(0, 3)
        self.running.append(_Request(key, torch.cat([prefix, own]), own, last, pending, finish))

    def _finish(self, req: _Request) -> None:
        if req.pending is not None:
            assert req.pending.wait()
        # The forward waits for every load issued before it (the load stream on a GPU): a device hit
        # may include nodes another request's load is still filling.
        for handle, _ in list(self.cache.transfer.loads):
            handle.wait()
        n = len(req.key)
        got = self.cache.device_pool.read_tokens(req.slots)[:, :, :n]
        assert torch.equal(got, expected_kv(list(req.key.token_ids), 0, self.rank, self.spec.kv_heads))
        self.kv_checks += 1
        owned = self.cache.insert(req.key, req.slots)
        self.cache.device_pool.free(req.slots[owned:])
        self.cache.dec_lock_ref(req.last_node)
        self.running.remove(req)

    def caller_slots(self) -> torch.Tensor:
        return torch.cat([r.own for r in self.running]) if self.running else torch.empty(0, dtype=torch.int64)

    def finish(self) -> None:
        for request_id, _, _ in self.waiting:
            self.cache.release_prefetch(request_id)
        for req in list(self.running):
            self._finish(req)
        self.cache.flush()
        self.cache.check_integrity()
        self.cache.close()


# ---- many ranks -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, options: dict, num_steps: int,
               skip_agreement: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        tp = TPGroup.from_default_group()
        assert (tp.rank, tp.world_size) == (rank, world_size)
        agreed = tp.agree([rank + 1, 10 - rank], [rank, -rank, 7])  # MIN and MAX fields, one collective
        assert agreed == ([1, 11 - world_size], [world_size - 1, 0, 7])
        assert tp.collectives == 1
        run = _Workload(rank, world_size, tp, seed=1234, store_dir=os.path.join(out_dir, "l3"), **options)
        delays = random.Random(100 + rank)  # only the copy worker thread draws from it
        run.cache.transfer.delay_hook = lambda kind: time.sleep(delays.choice(COPY_DELAYS_S))
        racer = random.Random(200 + rank)
        if skip_agreement:  # the negative control: rank 0 always done, the others always late
            run.cache.transfer.delay_hook = lambda kind: time.sleep(0.05 if rank else 0.0)
            run.cache.step = lambda: _step_without_agreement(run.cache)
        agreed_log = _log_agreements(tp)
        for step in range(num_steps):
            run.step(step)
            if (skip_agreement and rank == 0) or racer.random() < 0.4:  # this rank's copies all finished
                run.cache.transfer.synchronize()
            time.sleep(0.001)  # the forward pass, while storage I/O goes on
            before = tp.collectives
            run.cache.step()
            assert tp.collectives == before + 1, "a step must run exactly one collective"
            run.cache.check_integrity(caller_device_slots=run.caller_slots())
            tp.check_same_tree(run.cache.tree, include_slots=True)
        run.finish()
        tp.check_same_tree(run.cache.tree, include_slots=True)
        behind = sum(local != agreed for local, agreed in agreed_log)
        storage_stats = vars(run.cache.storage.stats) if run.cache.storage is not None else {}
        summary = {"steps_behind": behind, "kv_checks": run.kv_checks, "stats": vars(run.cache.stats),
                   "storage_stats": storage_stats, "digest": tree_digest(run.cache.tree)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def _step_without_agreement(cache: HiRadixCache) -> None:
    """The bug the agreement prevents: each rank retires what it alone has finished."""
    cache.tp.collectives += 1  # stands in for the collective, so the step still counts one
    cache.apply_progress(*cache.local_progress())


def _log_agreements(tp: TPGroup) -> list[tuple[list[int], list[int]]]:
    """Record (local, agreed) MIN fields of every agreement ``tp`` runs from now on."""
    log: list[tuple[list[int], list[int]]] = []
    agree = tp.agree

    def logged(min_values: list[int], max_values: list[int] = ()) -> tuple[list[int], list[int]]:
        result = agree(min_values, max_values)
        log.append((list(min_values), result[0]))
        return result

    tp.agree = logged  # type: ignore[method-assign]
    return log


def _start_ranks(world_size: int, out_dir: Path, options: dict, num_steps: int,
                 skip_agreement: bool = False) -> None:
    # forkserver: children start as clean as with spawn, but torch is imported once, not once per rank.
    mp.set_forkserver_preload(["torch", "torch.distributed", "tierkv.cache.hicache", "tierkv.tp"])
    mp.start_processes(_rank_main, args=(world_size, _free_port(), str(out_dir), options, num_steps,
                                         skip_agreement), nprocs=world_size, start_method="forkserver")


@pytest.mark.parametrize("world_size,options", [
    (2, dict(page_size=1, write_policy="write_through",
             storage=dict(prefetch_threshold=8, prefetch_stop_policy="best_effort"))),
    (4, dict(page_size=4, write_policy="write_through_selective", host_layout="page_first",
             io_backend="direct", eviction_policy="lfu",
             storage=dict(prefetch_threshold=8, prefetch_stop_policy="timeout", prefetch_timeout_base=0.002,
                          prefetch_timeout_per_ki_token=0.01, prefetch_batch_pages=2, backup_batch_pages=2))),
])
def test_ranks_with_different_delays_keep_identical_trees(tmp_path: Path, world_size: int,
                                                           options: dict) -> None:
    _start_ranks(world_size, tmp_path, options, num_steps=120)
    summaries = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]
    assert len({s["digest"] for s in summaries}) == 1
    assert all(s["stats"] == summaries[0]["stats"] for s in summaries)
    assert all(s["storage_stats"] == summaries[0]["storage_stats"] for s in summaries)
    # The workload really exercised every tier, and some rank really was ahead of the agreed counts.
    stats, storage = summaries[0]["stats"], summaries[0]["storage_stats"]
    assert stats["written_tokens"] > 0 and stats["loaded_tokens"] > 0 and stats["evicted_device_tokens"] > 0
    assert storage["backed_up_tokens"] > 0 and storage["prefetched_tokens"] > 0, storage
    assert summaries[0]["kv_checks"] > 20
    assert sum(s["steps_behind"] for s in summaries) > 0


def test_without_agreement_the_trees_diverge(tmp_path: Path) -> None:
    """The check above has teeth: retiring by local counts while one rank lags splits the trees."""
    with pytest.raises(mp.ProcessRaisedException, match="diverged from rank 0"):
        _start_ranks(2, tmp_path, dict(page_size=1, write_policy="write_through"), num_steps=120,
                     skip_agreement=True)
