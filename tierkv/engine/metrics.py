"""Prometheus metrics of a serving engine, through ``prometheus_client`` (text 0.0.4 and OpenMetrics).

Totals are read from the engine's counters at scrape time (a handful of integer reads under the engine
lock, never a walk over requests); TTFT is a Histogram observed once per request, so a scrape costs the
same after five requests or five million. Hit tokens are labelled by ``cache_source`` (device / host /
storage, SGLang's label), capacities and usage by ``tier``.
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Reads one engine's counters, pool sizes and storage statistics when scraped."""

    def __init__(self, engine, lock: threading.Lock, dp_rank: int = 0) -> None:
        self.engine, self.lock, self.dp_rank = engine, lock, dp_rank

    def describe(self) -> list[Metric]:
        return []  # register without calling collect() (which would take the engine lock at import)

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            metrics = list(self._request_metrics()) + list(self._cache_metrics()) + list(self._storage_metrics())
        yield from metrics

    def _request_metrics(self) -> Iterator[Metric]:
        c, sched = self.engine.scheduler.counters, self.engine.scheduler
        yield _counter("tierkv_requests", "Requests by outcome.", "status",
                       {"submitted": c.requests_submitted, "finished": c.requests_finished,
                        "failed": c.requests_failed})
        yield _counter("tierkv_prompt_tokens", "Prompt tokens of admitted requests.", None, {None: c.prompt_tokens})
        yield _counter("tierkv_generation_tokens", "Generated tokens.", None, {None: c.generated_tokens})
        yield _counter("tierkv_cache_hit_tokens", "Prompt tokens served from the cache, by where they were found.",
                       "cache_source", {"device": c.device_hit_tokens, "host": c.host_hit_tokens,
                                        "storage": c.storage_hit_tokens})
        yield _gauge("tierkv_running_requests", "Requests in the running batch.", None, {None: len(sched.running)})
        yield _gauge("tierkv_waiting_requests", "Requests waiting for admission.", None, {None: len(sched.waiting)})

    def _cache_metrics(self) -> Iterator[Metric]:
        cache, stats = self.engine.cache, self.engine.cache.stats
        capacity = {"device": cache.device_pool.num_slots}
        used = {"device": cache.device_pool.num_slots - cache.device_pool.num_free_slots}
        if cache.host_pool is not None:
            capacity["host"] = cache.host_pool.num_slots
            used["host"] = cache.host_pool.num_slots - cache.host_pool.num_free_slots
        yield _gauge("tierkv_cache_capacity_tokens", "Token slots of a tier.", "tier", capacity)
        yield _gauge("tierkv_cache_used_tokens", "Token slots in use in a tier (cached or held by requests).",
                     "tier", used)
        yield _counter("tierkv_evicted_tokens", "Tokens evicted from a tier.", "tier",
                       {"device": stats.evicted_device_tokens, "host": stats.evicted_host_tokens})
        yield _counter("tierkv_backed_up_tokens", "Tokens copied from device to host.", None,
                       {None: stats.written_tokens})
        yield _counter("tierkv_loaded_back_tokens", "Tokens copied from host back to device.", None,
                       {None: stats.loaded_tokens})
        yield _counter("tierkv_failed_copies", "Device/host copies that failed (their hits were dropped).", None,
                       {None: stats.failed_copies})

    def _storage_metrics(self) -> Iterator[Metric]:
        """L3 counters labelled like HiCache's StorageMetricsCollector: backend, tp_rank, dp_rank."""
        storage = getattr(self.engine.cache, "storage", None)
        if storage is None:
            return
        s, store = storage.stats, storage.store.stats
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
        yield _labelled("tierkv_storage_prefetches", "Prefetches by outcome.", where, "outcome",
                        {"started": s.prefetch_started, "revoked": s.prefetch_revoked, "aborted": s.prefetch_aborted,
                         "rate_limited": s.prefetch_rate_limited, "no_room": s.prefetch_no_room})


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
    """One registry per server: the engine collector plus the TTFT histogram the server observes."""

    def __init__(self, engine, lock: threading.Lock, dp_rank: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, lock, dp_rank))
        self.ttft = Histogram("tierkv_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=TTFT_BUCKETS_S, registry=self.registry)
