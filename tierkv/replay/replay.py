"""Drive the real :class:`HiRadixCache` with a trace, one request at a time, counting hits per tier.

Per request, as a scheduler would: match the prompt; prefetch the part past the L2 hit from L3 (when an
L3 is attached, waiting for completion so the count is deterministic); load the host part back into L1;
lock the prefix; allocate L1 slots for the uncached suffix (evicting as needed); write the suffix's KV;
insert the sequence; unlock; then retire all copies (``flush``), so every write-through has landed before
the next request and a replay is deterministic.

Hits are exact token counts: L1 = the device part of the match; L2 = host tokens actually loaded back;
L3 = prefetched tokens actually loaded back. A host hit that is not loaded (under the load-back threshold
or no room in L1) is recomputed and counts as a miss.

The pools are real but tiny: one layer, one head, head dim 1, float64, so a token's KV is 16 bytes and
holds the token id itself. ``verify`` reads every reused prefix back from L1 and checks it is exactly the
prompt's token ids, which catches any wrong KV delivered by a load back or an L3 prefetch.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.cache.config import CacheConfig, scaled_load_chunk_tokens
from tierkv.cache.hicache import HiRadixCache, MatchResult
from tierkv.cache.l3.controller import open_storage
from tierkv.pools import DeviceKVPool, HostKVPool, KVSpec
from tierkv.radix import RadixKey
from tierkv.replay.trace import TraceRequest
from tierkv.storage.factory import redact_spec
from tierkv.validate import check_bool, check_int, check_text

REPLAY_KV_SPEC = KVSpec(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float64)


def prompt_key(tokens: np.ndarray) -> RadixKey:
    """The cache key of a replayed prompt (int64 ids): as an ``array('q')``, which RadixKey adopts
    (tree keys are ``array('q')``) instead of converting each id; filled in one memcpy (``tobytes``
    and ``array('q', bytes)`` would copy twice)."""
    ids = array("q")
    ids.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).view(np.uint8))
    return RadixKey(ids)


@dataclass(frozen=True)
class ReplayConfig:
    """Sizes and policies of one replayed cache. ``l2_tokens=None`` is an L1-only radix cache."""

    l1_tokens: int
    l2_tokens: int | None = None
    page_size: int = 16
    eviction_policy: str = CacheConfig.eviction_policy
    write_policy: str = "write_through"
    l3: str = "none"
    include_output: bool = False
    verify: bool = False
    load_back_threshold: int = 10
    tier_mode: str = CacheConfig.tier_mode
    l2_admission: bool = False
    split_victims: bool = True  # CacheConfig.split_victims
    load_chunk_tokens: int | None = None  # CacheConfig.load_chunk_tokens; None: scaled_load_chunk_tokens
    l3_tokens: int | None = None  # a bounded L3's capacity, for MIN's bound (None: unbounded)

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, minimum=1)
        check_int("l1_tokens", self.l1_tokens, minimum=self.page_size)
        if self.l2_tokens is not None:
            check_int("l2_tokens", self.l2_tokens, minimum=self.l1_tokens + 1)
        check_bool("include_output", self.include_output)
        check_bool("verify", self.verify)
        check_text("l3", self.l3, allow_empty=False, secret=True)
        if self.l3 != "none" and self.l2_tokens is None:
            raise ValueError(f"l3 {redact_spec(self.l3)!r} needs an L2 tier (l2_tokens), got l2_tokens=None")
        if self.l3_tokens is not None:
            check_int("l3_tokens", self.l3_tokens, minimum=0)
        self.cache_config()

    def cache_config(self) -> CacheConfig:
        return CacheConfig(page_size=self.page_size, eviction_policy=self.eviction_policy,
                           write_policy=self.write_policy, load_back_threshold=self.load_back_threshold,
                           enable_host=self.l2_tokens is not None, tier_mode=self.tier_mode,
                           l2_admission=self.l2_admission, split_victims=self.split_victims,
                           load_chunk_tokens=scaled_load_chunk_tokens(self.l1_tokens, self.page_size)
                           if self.load_chunk_tokens is None else self.load_chunk_tokens,
                           overlap_cpu_writes=False)  # each request's writes are waited for (flush)

    @property
    def total_tokens(self) -> int:
        """L1 plus L2 capacity: what the tiers can hold at most without L3."""
        return self.l1_tokens + (self.l2_tokens or 0)


@dataclass
class RequestHits:
    """Token counts of one replayed request. ``cached`` is False when L1 had no room for it at all."""

    prompt_tokens: int
    l1: int = 0
    l2: int = 0
    l3: int = 0
    cached: bool = True

    @property
    def hit_tokens(self) -> int:
        return self.l1 + self.l2 + self.l3


class RequestHitsLog(Sequence[RequestHits]):
    """Every request's :class:`RequestHits`, kept as int columns (40 B a request, where the objects took
    ~250 B), each item made when read; tier totals are kept as requests are added."""

    _COLUMNS = ("prompt_tokens", "l1", "l2", "l3", "cached")

    def __init__(self, hits: Iterable[RequestHits] = ()) -> None:
        self._columns = {name: array("q") for name in self._COLUMNS}
        self.totals = dict.fromkeys(self._COLUMNS, 0)
        for h in hits:
            self.append(h)

    def append(self, hits: RequestHits) -> None:
        for name, column in self._columns.items():
            value = int(getattr(hits, name))
            column.append(value)
            self.totals[name] += value

    def __len__(self) -> int:
        return len(self._columns["l1"])

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        c = self._columns
        return RequestHits(c["prompt_tokens"][i], c["l1"][i], c["l2"][i], c["l3"][i], bool(c["cached"][i]))

    def __iter__(self) -> Iterator[RequestHits]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


@dataclass
class ReplayResult:
    """Per-request hits of one replay plus the cache's movement counters (in tokens)."""

    config: ReplayConfig
    requests: RequestHitsLog = field(default_factory=RequestHitsLog)
    written_l1_l2_tokens: int = 0
    loaded_l2_l1_tokens: int = 0
    backed_up_l2_l3_tokens: int = 0
    prefetched_l3_l2_tokens: int = 0
    uncached_requests: int = 0
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.requests, RequestHitsLog):
            self.requests = RequestHitsLog(self.requests)

    def tier_hits(self) -> dict[str, int]:
        return {t: self.requests.totals[t] for t in ("l1", "l2", "l3")}

    @property
    def prompt_tokens(self) -> int:
        return self.requests.totals["prompt_tokens"]

    @property
    def hit_ratio(self) -> float:
        total = self.prompt_tokens
        return sum(self.tier_hits().values()) / total if total else 0.0


class TraceReplayer:
    """One cache (tiers per :class:`ReplayConfig`) fed request by request. Call :meth:`close` at the end."""

    def __init__(self, config: ReplayConfig) -> None:
        self.config = config
        device_pool = DeviceKVPool(REPLAY_KV_SPEC, config.l1_tokens, config.page_size, "cpu")
        host_pool = None
        if config.l2_tokens is not None:
            host_pool = HostKVPool(REPLAY_KV_SPEC, config.l2_tokens + config.cache_config().staging_tokens,
                                   config.page_size, "page_first")
        self.cache = HiRadixCache(device_pool, config.cache_config(), host_pool=host_pool)
        # L1's K and V rows, one float64 per token slot (REPLAY_KV_SPEC), as numpy: verify writes and
        # reads them by slot index, one scatter or gather per request (torch's indexing costs more)
        self.kv_rows = device_pool.buffer.view(REPLAY_KV_SPEC.num_kv, device_pool.num_slots).numpy()
        # the same rows by page: slots come in whole aligned pages, so verify moves one page per index
        # (a 16-token row) instead of one token per index
        self.kv_pages = self.kv_rows.reshape(REPLAY_KV_SPEC.num_kv, -1, config.page_size)
        self.storage = None
        if config.l3 != "none":
            self.storage = L3Tier(self.cache, config.l3)
        self.result = ReplayResult(config)

    def serve(self, req: TraceRequest) -> RequestHits:
        """Replay one request. Lock contract: holds a lock on its prefix only while inserting."""
        cache = self.cache
        prompt = req.prompt_array()  # built once per request; the key and the checks reuse it
        key = prompt_key(prompt)
        match = cache.match_prefix(key)
        hits = RequestHits(req.input_length, l1=len(match.device_indices))
        l3_tokens = 0
        if self.storage is not None:
            match, l3_tokens = self.storage.prefetch(req.index, key, match)
        load = cache.init_load_back(match.last_host_node)
        prefix, last_node = match.device_indices, match.last_device_node
        if load.loaded_tokens and (load.pending is None or load.pending.wait()):
            # L3's tokens end the host path: a load cut short (chunks, exclusive tiers) loads L2's first
            hits.l3 = max(0, load.loaded_tokens - (match.host_hit_length - l3_tokens))
            hits.l2 = load.loaded_tokens - hits.l3
            prefix, last_node = load.device_indices, load.last_node
        # a failed load's slots are dropped by the next step; its tokens are recomputed
        if self.config.verify:
            self._verify(prefix, prompt)
        if self.config.include_output:
            prompt = np.concatenate([prompt, np.asarray(req.output_tokens(), dtype=np.int64)])
            key = prompt_key(prompt)
        cache.inc_lock_ref(last_node)
        try:
            hits.cached = self._insert(key, prompt, prefix)
        finally:
            cache.dec_lock_ref(last_node)
        cache.flush()
        self.result.requests.append(hits)
        return hits

    def _insert(self, key: RadixKey, tokens: np.ndarray, prefix: torch.Tensor) -> bool:
        """Allocate and fill slots for the uncached suffix, then insert; False when L1 has no room."""
        page = self.config.page_size
        num_new = len(tokens) - len(prefix)
        num_alloc = -(-num_new // page) * page
        new_slots = self.cache.alloc_device(num_alloc) if num_alloc else prefix[:0]
        if new_slots is None:
            self.result.uncached_requests += 1
            return False
        if self.config.verify and num_alloc:
            ids = np.empty(num_alloc)
            ids[:num_new] = tokens[len(prefix):]  # K and V of each new token: its id
            ids[num_new:] = -1.0  # the partial page's padding
            pages = new_slots.numpy()[::page] // page
            for row in self.kv_pages:  # K, then V: per row, numpy's page scatter is ~2x faster than in 3-D
                row[pages] = ids.reshape(-1, page)
        owned = self.cache.insert(key, torch.cat([prefix, new_slots]))
        leftover = new_slots[owned - len(prefix):]
        if len(leftover):
            self.cache.device_pool.free(leftover)
        return True

    def _verify(self, prefix: torch.Tensor, prompt: np.ndarray) -> None:
        if not len(prefix):
            return
        page = self.config.page_size
        slots = prefix.numpy()
        num_full = len(slots) // page * page  # a prompt's last page may be partial
        firsts = slots[:num_full:page]
        # the allocator hands out whole aligned pages; its copies check page endpoints, and so does this
        if (firsts % page).any() or (slots[page - 1:num_full:page] - firsts != page - 1).any():
            raise AssertionError("reused KV slots do not form whole aligned pages")
        pages, tail = firsts // page, slots[num_full:]
        want = prompt[:num_full].reshape(-1, page)
        if (all((row.take(pages, axis=0) == want).all() for row in self.kv_pages)
                and (self.kv_rows[:, tail] == prompt[num_full:len(slots)]).all()):
            return  # the usual case, in one gather and compare per row; else find the positions
        num_kv = self.kv_pages.shape[0]
        kv = np.concatenate([self.kv_pages[:, pages].reshape(num_kv, -1), self.kv_rows[:, tail]], axis=1)
        wrong = kv != prompt[:len(prefix)]
        if wrong.any():
            bad = np.flatnonzero(wrong.any(0))[:4].tolist()
            raise AssertionError(f"reused KV differs from the prompt at positions {bad}")

    def finish(self) -> ReplayResult:
        """Flush, collect the movement counters and close the cache."""
        self.cache.flush()
        stats, result = self.cache.stats, self.result
        result.written_l1_l2_tokens = stats.written_tokens
        result.loaded_l2_l1_tokens = stats.loaded_tokens
        if self.storage is not None:
            result.backed_up_l2_l3_tokens, result.prefetched_l3_l2_tokens = self.storage.moved_tokens()
        self.cache.close()
        return result


class L3Tier:
    """The L3 side of a replay: one prefetch per request, waited for to completion (wait_complete)."""

    def __init__(self, cache: HiRadixCache, spec: str) -> None:
        # xxh3 page hashes: the replay hashes every page it backs up, and sha256 would dominate its time
        extra = json.dumps({"prefetch_stop_policy": "wait_complete", "hash_algorithm": "xxh3_128"})
        self.cache = cache
        self.controller = open_storage(cache, spec, extra, namespace="tierkv-replay")

    def prefetch(self, request_index: int, key: RadixKey, match: MatchResult) -> tuple[MatchResult, int]:
        """Fetch what L3 holds past the L2 hit into L2; the new match and the tokens it added.

        Lock contract: the prefetch protects its L2 anchor until it ends, which is before returning.
        """
        request_id = f"replay-{request_index}"
        if not self.cache.prefetch_from_storage(request_id, match.last_host_node, key):
            return match, 0
        prefetch = self.controller.prefetches.get(request_id)
        while not self.cache.check_prefetch_progress(request_id):
            # the worker reads the store; its progress is agreed in step() (which also grants the slots
            # for what its lookup found). Blocking on the prefetch's own events instead of polling costs
            # a wake-up or two per request.
            if prefetch is not None:
                prefetch.wait_worker(self.controller.config.io_wait_timeout_s)
            self.cache.step()
        again = self.cache.match_prefix(key)
        before = len(match.device_indices) + match.host_hit_length
        return again, len(again.device_indices) + again.host_hit_length - before

    def moved_tokens(self) -> tuple[int, int]:
        """Tokens written L2 -> L3 and read L3 -> L2."""
        stats = self.controller.stats
        return stats.backed_up_tokens, stats.prefetched_tokens


def replay(requests: list[TraceRequest], config: ReplayConfig,
           on_request: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` through a fresh cache; ``on_request(i)`` is called after each (progress bars)."""
    start = time.perf_counter()
    replayer = TraceReplayer(config)
    try:
        for i, req in enumerate(requests):
            replayer.serve(req)
            if on_request is not None:
                on_request(i)
    finally:
        result = replayer.finish()
    result.wall_s = time.perf_counter() - start
    return result
