"""Continuous batching over the hierarchical cache.

Each step: retire finished cache copies (``cache.step()``), admit waiting requests (match the prompt,
load host hits back, lock the matched path, allocate slots for the rest; a request that does not fit
waits), then run one forward pass mixing one decode token per running request with chunks of
uncached prompt suffixes, sample greedily, and finish requests (insert their tokens, unlock, free).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tierkv.engine.request import Request
from tierkv.engine.runner import ModelRunner, WorkItem
from tierkv.engine.step_costs import TimedLoads, report_step
from tierkv.cache.hicache import HiRadixCache
from tierkv.radix import RadixKey
from tierkv.validate import check_bool, check_int

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)
IDLE_WAIT_S = 0.0005


@dataclass(frozen=True)
class SchedulerConfig:
    """``chunk_tokens`` caps the prompt tokens prefilled per step (chunked prefill); ``use_prefix_cache``
    False runs the same engine with no reuse (the baseline the exactness tests compare against);
    ``layerwise_load`` batches a step's L2 -> L1 loads and lets each layer wait for its own copy only
    (HiCache's load-back), else each load is waited for whole at admission."""

    max_running_requests: int = 16
    chunk_tokens: int = 256
    use_prefix_cache: bool = True
    layerwise_load: bool = True

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunk_tokens"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("use_prefix_cache", "layerwise_load"):
            check_bool(name, getattr(self, name))


@dataclass
class EngineCounters:
    """Totals for /metrics and benchmarks."""

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0  # aborted before they finished (their client went away)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    restarted_requests: int = 0  # a layer-wise prefix load failed under them: recomputed
    first_tokens: int = 0
    ttft_sum_s: float = 0.0  # a sum, not a list: the counters must not grow with every request served


class Scheduler:
    """Runs requests to completion over ``runner`` with ``cache`` managing every device slot."""

    def __init__(self, runner: ModelRunner, cache: HiRadixCache, config: SchedulerConfig | None = None) -> None:
        if cache.device_pool is not runner.pool:
            raise ValueError("the cache must manage the runner's device pool")
        self.runner, self.cache = runner, cache
        self.config = config or SchedulerConfig()
        self.page_size = cache.config.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = EngineCounters()
        self.prefetcher = None  # set by tierkv.engine.prefetch.attach_l3 when L3 is on
        self._loaded_tokens = 0  # host tokens whose L1 load this step's admissions queued

    # ---- public API ------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue ``request``; one that could never fit in the device pool fails at once (``request.error``),
        before any lookup, prefetch or eviction could disturb what the cache holds."""
        request.arrival_s = time.perf_counter()
        self.counters.requests_submitted += 1
        if request.cancelled:  # aborted before it reached the scheduler
            self._end_cancelled(request)
            return request
        if not self._can_ever_fit(request):
            self._fail(request, f"request needs {request.max_kv_tokens} KV slots; the device pool "
                                f"has {self.cache.device_pool.num_slots}")
            return request
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> None:
        """End ``request`` now, between steps (no load of its prefix is then in flight): a waiting one leaves the queue (its prefetch released), a
        running one inserts the KV it computed (unlocked, evictable), unlocks its prefix and frees its own
        slots. Safe for a request not (or no longer) in the scheduler: it is marked, and refused at submit.
        Lock contract: releases the request's lock_ref on its prefix path."""
        if request.finished:
            return
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
            if self.prefetcher is not None:
                self.prefetcher.abort(request)
        elif request in self.running:
            self.running.remove(request)
            self._release(request)
        else:
            return  # not submitted yet: submit() ends it
        self._end_cancelled(request)

    def _end_cancelled(self, request: Request) -> None:
        request.finished, request.finish_s = True, time.perf_counter()
        self.counters.requests_cancelled += 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """One scheduler iteration; returns the requests that finished in it."""
        self.cache.step()
        self._admit()
        if not self.running:
            if self.waiting:  # blocked on a prefetch or on copies: let their threads have the CPU
                time.sleep(IDLE_WAIT_S)
            return []
        items, sampled = self._plan()
        on_cuda = self.cache.device_pool.device.type == "cuda"
        loads = TimedLoads(self.cache.start_loading(), on_cuda) if self.config.layerwise_load else None
        started_s = time.perf_counter()
        storage = self.cache.storage
        with storage.pacer.busy() if storage is not None else nullcontext():  # backups wait for a gap
            logits = self.runner.forward(items, loads)
        report_step(self.cache.cost_model, items, logits, started_s, loads, self._loaded_tokens)
        self._loaded_tokens = 0
        return self._advance(sampled, logits)

    def run(self, requests: list[Request] | None = None) -> list[Request]:
        """Submit ``requests`` and step until nothing is left; returns them."""
        for r in requests or []:
            self.submit(r)
        while self.has_work:
            self.step()
        return requests or []

    def owned_device_slots(self) -> torch.Tensor:
        """Slots running requests own (for ``cache.check_integrity``)."""
        owned = [r.own_slots for r in self.running]
        return torch.cat(owned) if owned else _EMPTY

    # ---- admission -------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.prefetcher is not None:  # start L3 fetches early so they overlap the running batch
            for request in list(self.waiting)[: 2 * self.config.max_running_requests]:
                self.prefetcher.start(request)
        waited = False
        for request in list(self.waiting)[: 2 * self.config.max_running_requests]:
            if len(self.running) >= self.config.max_running_requests:
                break
            if self.prefetcher is not None and not self.prefetcher.ready(request):
                # one bounded wait per step; past it, requests behind need not wait for this L3 read
                if waited:
                    continue
                waited = True
                if not self.prefetcher.wait(request):
                    continue
            if not self._try_start(request):
                break  # FCFS: later requests wait behind the head so it cannot starve
            self.waiting.remove(request)
            self.running.append(request)
            if self.prefetcher is not None:
                self.prefetcher.admitted(request)

    def _can_ever_fit(self, request: Request) -> bool:
        return self._page_ceil(request.max_kv_tokens) <= self.cache.device_pool.num_slots

    def _page_ceil(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) * self.page_size

    def _room(self) -> int:
        return self.cache.device_pool.num_free_slots + self.cache.evictable_size

    def _try_start(self, request: Request) -> bool:
        """Match, load back, lock, allocate. On failure nothing stays locked or allocated."""
        if self._page_ceil(request.max_new_tokens) > self._room():
            return False  # cannot fit even with a full prompt hit: skip the lookup
        prefix, node = _EMPTY, None
        if self.config.use_prefix_cache:
            prefix, node = self._lookup(request)
            self.cache.inc_lock_ref(node)
        own = self.cache.alloc_device(self._page_ceil(request.max_kv_tokens - len(prefix)))
        if own is None:
            if node is not None:
                self.cache.dec_lock_ref(node)
            return False
        request.slots = torch.cat([prefix, own])
        request.cached_len = request.num_computed = len(prefix)
        request.locked_node = node
        request.admitted_s = time.perf_counter()
        self.counters.prompt_tokens += len(request.prompt)
        return True

    def _lookup(self, request: Request):
        """Device indices of the usable cached prefix and the node ending it (not yet locked by us)."""
        # the last prompt token is always recomputed: its logits give the first output token
        match = self.cache.match_prefix(RadixKey(request.prompt[:-1], request.extra_key))
        prefix, node = match.device_indices, match.last_device_node
        request.device_hit_tokens = len(prefix)
        # after a failed load: recompute, no retry; a load slower than recomputing is skipped too
        if match.host_hit_length > 0 and request.restarts == 0 and \
                self.cache.cost_model.load_pays(len(prefix), match.host_hit_length):
            defer = self.config.layerwise_load  # started with the step's other loads; checked in _advance
            loaded = self.cache.init_load_back(match.last_host_node, defer=defer)
            if defer:
                self._loaded_tokens += loaded.loaded_tokens
            if defer or self._wait_load(loaded):
                prefix, node = loaded.device_indices, loaded.last_node
                request.pending_load = loaded.pending if defer else None
            request.host_hit_tokens = len(prefix) - request.device_hit_tokens
        if self.prefetcher is not None:
            request.storage_hit_tokens = min(self.prefetcher.storage_tokens(request, len(prefix)),
                                             request.host_hit_tokens)
            request.host_hit_tokens -= request.storage_hit_tokens
        return prefix, node

    def _wait_load(self, loaded) -> bool:
        """Wait for a load at admission (not layer-wise): all of it is exposed; True if it succeeded."""
        if loaded.pending is None:
            return True
        started_s = time.perf_counter()
        ok = loaded.pending.wait()
        self.cache.cost_model.observe_load(time.perf_counter() - started_s, loaded.loaded_tokens)
        return ok

    # ---- one forward pass ----------------------------------------------------------------------
    def _plan(self) -> tuple[list[WorkItem], list[tuple[Request, int]]]:
        """Decode tokens first (latency), then prompt chunks within the token budget."""
        items, sampled, budget = [], [], self.config.chunk_tokens
        for r in sorted(self.running, key=lambda r: r.in_prefill):
            if r.in_prefill:
                if budget <= 0:
                    continue
                n = min(budget, len(r.prompt) - r.num_computed)
                budget -= n
            else:
                n = 1
            end = r.num_computed + n
            sample = end == len(r.prompt) + len(r.output)
            items.append(WorkItem(r.all_tokens[r.num_computed:end], r.slots[:end], sample))
            sampled.append((r, n))
        return items, sampled

    def _advance(self, sampled: list[tuple[Request, int]], logits: torch.Tensor) -> list[Request]:
        now = time.perf_counter()
        finished, row = [], 0
        for r, n in sampled:
            if r.pending_load is not None:
                load_ok, r.pending_load = r.pending_load.wait(), None
                if not load_ok:  # this pass read garbage for its prefix: drop its result, recompute
                    row += int(r.num_computed + n >= len(r.all_tokens))
                    self._restart(r)
                    continue
            r.num_computed += n
            if r.num_computed < len(r.all_tokens):
                continue
            token_logits = logits[row].cpu()
            row += 1
            token = int(token_logits.argmax())
            if r.first_token_s is None:
                r.first_token_s, r.first_logits = now, token_logits
                self.counters.first_tokens += 1
                self.counters.ttft_sum_s += r.ttft_s
            r.last_logits = token_logits
            r.output.append(token)
            self.counters.generated_tokens += 1
            if r.on_token is not None:
                r.on_token(r, token)
            if len(r.output) >= r.max_new_tokens or token == r.eos_token_id or r.stop_requested:
                self._finish(r)
                finished.append(r)
        return finished

    # ---- completion ------------------------------------------------------------------------------
    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.finished, request.finish_s = True, time.perf_counter()
        c = self.counters
        c.requests_finished += 1
        c.device_hit_tokens += request.device_hit_tokens
        c.host_hit_tokens += request.host_hit_tokens
        c.storage_hit_tokens += request.storage_hit_tokens

    def _release(self, request: Request) -> None:
        """Insert the tokens whose KV was computed, unlock the prefix, free what the tree did not take.
        Lock contract: releases the request's lock_ref on ``locked_node``."""
        n_kv = request.num_computed
        if self.config.use_prefix_cache:
            kept = self.cache.insert(RadixKey(request.all_tokens[:n_kv], request.extra_key), request.slots[:n_kv])
            self.cache.device_pool.free(request.slots[kept:])
            self.cache.dec_lock_ref(request.locked_node)
        else:
            self.cache.device_pool.free(request.own_slots)
        request.locked_node, request.slots = None, None

    def _restart(self, request: Request) -> None:
        """Its prefix load failed: release its slots and lock and queue it again at the head; the cache
        keeps the failed nodes out of later matches, so it recomputes what L1 no longer holds."""
        self.running.remove(request)
        self.cache.device_pool.free(request.own_slots)
        self.cache.dec_lock_ref(request.locked_node)
        request.slots, request.locked_node = None, None
        request.cached_len = request.num_computed = 0
        request.device_hit_tokens = request.host_hit_tokens = request.storage_hit_tokens = 0
        self.counters.prompt_tokens -= len(request.prompt)  # counted again when it is admitted again
        self.counters.restarted_requests += 1
        request.restarts += 1
        self.waiting.appendleft(request)

    def _fail(self, request: Request, reason: str) -> None:
        log.warning("request %s failed: %s", request.rid, reason)
        request.error, request.finished, request.finish_s = reason, True, time.perf_counter()
        self.counters.requests_failed += 1
        if request.on_token is not None:
            request.on_token(request, -1)
