"""`/metrics` of `tierkv serve`: one ``tier`` label with a series only for the tiers the mode has, an L3
capacity/used gauge, ``requests_total`` as a partition by outcome, the latency histograms, and the cost
model's decisions."""

import http.client
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import prompts_with_shared_prefix, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.metrics import OUTCOMES
from tierkv.engine.server import CompletionServer

TIERED = ("tierkv_cache_hit_tokens_total", "tierkv_cache_capacity_tokens", "tierkv_cache_used_tokens")


@pytest.fixture(scope="module")
def model():
    return tiny_model("tiny-llama")


def post(port: int, body: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def scrape(port: int) -> list:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def tiers(samples, name: str) -> set[str]:
    return {s.labels["tier"] for s in samples if s.name == name}


def value(samples, name: str, **labels) -> float:
    (found,) = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return found


@pytest.mark.parametrize("mode, want", [("l1", {"device"}), ("l1+l2", {"device", "host"})])
def test_tier_series_exist_only_for_the_tiers_of_the_mode(model, mode, want):
    srv = CompletionServer(Engine(model, EngineConfig(mode=mode, l1_tokens=1024))).start()
    try:
        post(srv.port, {"prompt": "tiers", "max_tokens": 2})
        samples = scrape(srv.port)
        assert all(tiers(samples, name) == want for name in TIERED), {n: tiers(samples, n) for n in TIERED}
        assert not any("cache_source" in s.labels for s in samples)  # one label name for the tiers
        assert not any(s.name.startswith(("tierkv_storage_", "tierkv_cost_model")) for s in samples)
        assert ("host" in want) == any(s.name == "tierkv_backed_up_tokens_total" for s in samples)
    finally:
        srv.close()


def test_requests_total_is_a_partition_by_outcome_and_latencies_are_histograms(model):
    srv = CompletionServer(Engine(model, EngineConfig(mode="l1", l1_tokens=1024))).start()
    try:
        statuses = [post(srv.port, {"prompt": "ok", "max_tokens": 4}) for _ in range(3)]
        statuses += [post(srv.port, {"prompt": "ok", "max_tokens": 2, "stream": True})]
        statuses += [post(srv.port, {"prompt": "bad", "temperature": 0.5}), post(srv.port, {"prompt": 5})]
        assert statuses == [200] * 4 + [400, 400]
        samples = scrape(srv.port)
        outcomes = {s.labels["outcome"]: s.value for s in samples if s.name == "tierkv_requests_total"}
        assert set(outcomes) == set(OUTCOMES) and sum(outcomes.values()) == len(statuses)
        assert outcomes["finished"] == 4 and outcomes["refused_4xx"] == 2
        assert value(samples, "tierkv_e2e_request_latency_seconds_count") == 4
        assert value(samples, "tierkv_request_queue_time_seconds_count") == 4
        assert value(samples, "tierkv_inter_token_latency_seconds_count") == 3 * 3 + 1  # tokens after the first
        assert value(samples, "tierkv_time_to_first_token_seconds_count") == 4
    finally:
        srv.close()


def test_l3_tier_capacity_and_cost_model_decisions_are_exported(model, tmp_path):
    extra = {"prefetch_threshold": 8, "prefetch_stop_policy": "wait_complete", "max_bytes": 64 << 20}
    config = EngineConfig(mode="l1+l2+l3", l1_tokens=256, page_size=4, host_layout="page_first",
                          l3=f"file:{tmp_path}", storage_extra=extra)
    prompts = prompts_with_shared_prefix(2, prefix_len=64, suffix_len=8, seed=5)
    first = Engine(model, config)
    first.generate(prompts[:1], 2)
    first.close()  # its backups reach L3
    srv = CompletionServer(Engine(model, config)).start()
    try:
        post(srv.port, {"prompt": prompts[1], "max_tokens": 2})
        samples = scrape(srv.port)
        assert all(tiers(samples, name) == {"device", "host", "storage"} for name in TIERED)
        store = srv.loop.engine.cache.storage.store
        page_tokens = 4
        assert value(samples, "tierkv_cache_capacity_tokens", tier="storage") == \
            (64 << 20) // store.format.blob_nbytes * page_tokens
        assert value(samples, "tierkv_cache_used_tokens", tier="storage") >= 64  # the first engine's prefix
        assert value(samples, "tierkv_cache_hit_tokens_total", tier="storage") >= 60
        decisions = {s.labels["decision"] for s in samples if s.name == "tierkv_cost_model_skips_total"}
        assert decisions == {"lookup_skipped", "fetch_trimmed", "backup_skipped"}
        outcomes = {s.labels["outcome"] for s in samples if s.name == "tierkv_storage_prefetches_total"}
        assert {"started", "revoked", "not_worth", "rate_limited"} <= outcomes
        assert any(s.name == "tierkv_storage_backup_not_worth_tokens_total" for s in samples)
    finally:
        srv.close()
