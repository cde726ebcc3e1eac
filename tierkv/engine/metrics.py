"""Prometheus metrics of a serving engine, through ``prometheus_client`` (text 0.0.4 and OpenMetrics).

Totals are read from the engine's counters at scrape time (a handful of integer reads under the engine
lock, never a walk over requests); latencies are Histograms observed once per request or token, so a
scrape costs the same after five requests or five million. Every per-tier series carries one label,
``tier`` (device / host / storage), and only for the tiers the engine's mode has.
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
OUTCOMES = ("finished", "failed", "refused_4xx", "cancelled")


class EngineCollector:
    """Reads one engine's counters, pool sizes, storage statistics and cost-model decisions when scraped."""

    def __init__(self, engine, lock: threading.Lock, dp_rank: int = 0) -> None:
        self.engine, self.lock, self.dp_rank = engine, lock, dp_rank

    def describe(self) -> list[Metric]:
        return []  # register without calling collect() (which would take the engine lock at import)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            metrics = list(self._request_metrics()) + list(self._cache_metrics()) + list(self._storage_metrics())
        yield from metrics

    def _tiers(self) -> list[str]:
        cache = self.engine.cache
        return ["device"] + ["host"] * (cache.host_pool is not None) + ["storage"] * (cache.storage is not None)

    def _request_metrics(self) -> Iterator[Metric]:
        c, sched = self.engine.scheduler.counters, self.engine.scheduler
        hits = {"device": c.device_hit_tokens, "host": c.host_hit_tokens, "storage": c.storage_hit_tokens}
        yield _counter("tierkv_prompt_tokens", "Prompt tokens of admitted requests.", None, {None: c.prompt_tokens})
        yield _counter("tierkv_generation_tokens", "Generated tokens.", None, {None: c.generated_tokens})
        yield _counter("tierkv_cache_hit_tokens", "Prompt tokens served from the cache, by the tier they were "
                       "found in.", "tier", {tier: hits[tier] for tier in self._tiers()})
        yield _counter("tierkv_aborted_requests", "Requests the scheduler aborted before they finished (their "
                       "client went away); their slots and locks were released at once.", None,
                       {None: c.requests_cancelled})
        yield _gauge("tierkv_running_requests", "Requests in the running batch.", None, {None: len(sched.running)})
        yield _gauge("tierkv_waiting_requests", "Requests waiting for admission.", None, {None: len(sched.waiting)})

    def _cache_metrics(self) -> Iterator[Metric]:
        cache, stats = self.engine.cache, self.engine.cache.stats
        capacity = {"device": cache.device_pool.num_slots}
        used = {"device": cache.device_pool.num_slots - cache.device_pool.num_free_slots}
        evicted = {"device": stats.evicted_device_tokens}
        if cache.host_pool is not None:
            capacity["host"] = cache.host_pool.num_slots
            used["host"] = cache.host_pool.num_slots - cache.host_pool.num_free_slots
            evicted["host"] = stats.evicted_host_tokens
        storage_capacity, storage_used = _storage_tokens(cache)
        if storage_capacity is not None:
            capacity["storage"] = storage_capacity
        if storage_used is not None:
            used["storage"] = storage_used
        yield _gauge("tierkv_cache_capacity_tokens", "Token slots of a tier (storage: when its store is bounded).",
                     "tier", capacity)
        yield _gauge("tierkv_cache_used_tokens", "Token slots in use in a tier (cached or held by requests; "
                     "storage: pages this store holds, when it keeps count).", "tier", used)
        yield _counter("tierkv_evicted_tokens", "Tokens evicted from a tier.", "tier", evicted)
        if cache.host_pool is not None:
            yield _counter("tierkv_backed_up_tokens", "Tokens copied from device to host.", None,
                           {None: stats.written_tokens})
            yield _counter("tierkv_loaded_back_tokens", "Tokens copied from host back to device.", None,
                           {None: stats.loaded_tokens})
            yield _counter("tierkv_failed_copies", "Device/host copies that failed (their hits were dropped).",
                           None, {None: stats.failed_copies})

    def _storage_metrics(self) -> Iterator[Metric]:
        """L3 counters labelled like HiCache's StorageMetricsCollector: backend, tp_rank, dp_rank."""
        storage = self.engine.cache.storage
        if storage is None:
            return
        s, store, costs = storage.stats, storage.store.stats, self.engine.cache.cost_model
        where = {"backend": storage.store.name, "tp_rank": str(self.engine.cache.tp.rank),
                 "dp_rank": str(self.dp_rank)}
        yield _labelled("tierkv_storage_pages", "Pages read from and written to storage (L3).", where, "op",
                        {"get": store.get_pages, "set": store.set_pages})
        yield _labelled("tierkv_storage_bytes", "Bytes read from and written to storage (L3).", where, "op",
                        {"get": store.get_bytes, "set": store.set_bytes})
        yield _labelled("tierkv_storage_io_seconds", "Seconds spent in storage batch calls (rate over the pages "
                        "or bytes counter: latency per page, bandwidth).", where, "op",
                        {"get": store.get_seconds, "set": store.set_seconds})
        yield _labelled("tierkv_storage_exists_calls", "Storage existence queries (one per prefetch or backup).",
                        where, None, {None: store.exists_calls})
        yield _labelled("tierkv_storage_errors", "Storage errors and corrupt pages (each cost hits, not answers).",
                        where, "kind", {"error": store.errors, "corrupt": store.corrupt_pages})
        yield _labelled("tierkv_storage_evicted_pages", "Pages a bounded store evicted to stay under max_bytes.",
                        where, None, {None: store.evicted_pages})
        yield _labelled("tierkv_storage_prefetched_tokens", "Tokens prefetched from storage into host memory.",
                        where, None, {None: s.prefetched_tokens})
        yield _labelled("tierkv_storage_backed_up_tokens", "Tokens written from host memory to storage.", where,
                        None, {None: s.backed_up_tokens})
        yield _labelled("tierkv_storage_backup_dropped_tokens", "Tokens whose storage backup was dropped.", where,
                        None, {None: s.backup_dropped_tokens})
        yield _labelled("tierkv_storage_prefetches", "Prefetches by outcome (not_worth: the cost model judged "
                        "even a full hit slower than recomputing; revoked: too little found, no room or a failed "
                        "first read).", where, "outcome",
                        {"started": s.prefetch_started, "revoked": s.prefetch_revoked, "aborted": s.prefetch_aborted,
                         "rate_limited": s.prefetch_rate_limited, "no_room": s.prefetch_no_room,
                         "not_worth": s.prefetch_not_worth})
        yield _labelled("tierkv_cost_model_skips", "The cost model's refusals: lookups not made for a poor L3 hit "
                        "rate, fetches cut short as slower than recomputing, backups not written as not paying.",
                        where, "decision", {"lookup_skipped": costs.skipped_lookups,
                                            "fetch_trimmed": costs.skipped_fetches,
                                            "backup_skipped": costs.skipped_backups})
        yield _labelled("tierkv_storage_backup_not_worth_tokens", "Tokens the cost model did not back up to "
                        "storage (writing them costs more than their reads would save).", where, None,
                        {None: s.backup_not_worth_tokens})


def _storage_tokens(cache) -> tuple[int | None, int | None]:
    """(capacity, used) of a bounded L3 store in tokens; None where the store does not know."""
    storage = cache.storage
    if storage is None:
        return None, None
    store, page_size = storage.store, cache.config.page_size
    fmt = getattr(store, "format", None)
    blob_nbytes = getattr(fmt, "blob_nbytes", None) or store.page_nbytes
    max_bytes, size_bytes = getattr(store, "max_bytes", None), getattr(store, "size_bytes", None)
    capacity = None if max_bytes is None else max_bytes // blob_nbytes * page_size
    used = None if not isinstance(size_bytes, int) else size_bytes // blob_nbytes * page_size
    return capacity, used


def _labelled(name: str, doc: str, where: dict[str, str], label: str | None, values: dict) -> CounterMetricFamily:
    """A counter family whose every sample carries the ``where`` labels, plus ``label`` when given."""
    names = list(where) + ([label] if label else [])
    family = CounterMetricFamily(name, doc, labels=names)
    for key, value in values.items():
        family.add_metric(list(where.values()) + ([key] if label else []), value)
    return family


def _counter(name: str, doc: str, label: str | None, values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label] if label else None)
    for key, value in values.items():
        family.add_metric([key] if label else [], value)
    return family


def _gauge(name: str, doc: str, label: str | None, values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label] if label else None)
    for key, value in values.items():
        family.add_metric([key] if label else [], value)
    return family


class ServerMetrics:
    """One registry per server: the engine collector plus what the HTTP side observes: each completion
    request's outcome (a partition: finished + failed + refused_4xx + cancelled = requests answered),
    queue-full refusals, and the TTFT, end-to-end, inter-token and queue-time histograms."""

    def __init__(self, engine, lock: threading.Lock, dp_rank: int = 0) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=False)
        registry.register(EngineCollector(engine, lock, dp_rank))
        self.requests = Counter("tierkv_requests", "Completion requests by outcome (refused_4xx: any 4xx, "
                                "429 queue-full included; cancelled: the client went away).", ["outcome"],
                                registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.queue_full = Counter("tierkv_queue_full_refusals", "Requests refused with 429 because the waiting "
                                  "queue was at max_waiting_requests.", registry=registry)
        self.ttft = Histogram("tierkv_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS_S, registry=registry)
        self.e2e = Histogram("tierkv_e2e_request_latency_seconds", "Arrival to last token of finished requests.",
                             buckets=E2E_BUCKETS_S, registry=registry)
        self.inter_token = Histogram("tierkv_inter_token_latency_seconds", "Time between a request's "
                                     "consecutive generated tokens.", buckets=LATENCY_BUCKETS_S, registry=registry)
        self.queue_time = Histogram("tierkv_request_queue_time_seconds", "Arrival to admission into the "
                                    "running batch.", buckets=E2E_BUCKETS_S, registry=registry)
        self.mean_e2e_s = 0.0  # decayed mean of finished requests' latency: sizes 429's Retry-After

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def observe_finished(self, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.mean_e2e_s = e2e_s if self.mean_e2e_s == 0 else 0.9 * self.mean_e2e_s + 0.1 * e2e_s
