"""Storage metrics on the engine's /metrics registry, labelled like HiCache's StorageMetricsCollector."""

from __future__ import annotations

import threading

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import prompts_with_shared_prefix, single_torch_thread, tiny_model  # noqa: F401
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.metrics import ServerMetrics


def _l3_engine(model, store_dir) -> Engine:
    extra = {"prefetch_threshold": 8, "prefetch_stop_policy": "wait_complete"}
    return Engine(model, EngineConfig(mode="l1+l2+l3", l1_tokens=256, page_size=4, host_layout="page_first",
                                      l3=f"file:{store_dir}", storage_extra=extra))


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_storage_metrics_count_l3_traffic_per_backend_and_rank(tmp_path):
    model = tiny_model("tiny-llama")
    prompts = prompts_with_shared_prefix(2, prefix_len=64, suffix_len=8, seed=11)
    first = _l3_engine(model, tmp_path)
    first.generate(prompts[:1], 2)
    first.close()  # its backups reach L3
    second = _l3_engine(model, tmp_path)
    metrics = ServerMetrics(second, threading.Lock(), dp_rank=3)
    second.generate(prompts[1:], 2)  # a fresh engine: the shared prefix can only come from L3
    samples = _samples(metrics)
    where = (("backend", "file"), ("dp_rank", "3"), ("tp_rank", "0"))

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(dict(where, **labels).items())))]

    assert value("tierkv_storage_pages_total", op="get") >= 16  # 64 tokens in pages of 4
    assert value("tierkv_storage_bytes_total", op="get") == value("tierkv_storage_pages_total", op="get") * \
        second.cache.host_pool.page_nbytes
    assert value("tierkv_storage_io_seconds_total", op="get") > 0
    assert value("tierkv_storage_prefetched_tokens_total") >= 64
    assert value("tierkv_storage_prefetches_total", outcome="started") >= 1
    assert value("tierkv_storage_exists_calls_total") >= 1
    second.close()
