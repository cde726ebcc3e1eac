"""Prometheus text exposition of an engine's counters and its cache's statistics."""

from __future__ import annotations

from tierkv.engine.engine import Engine


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def render_metrics(engine: Engine) -> str:
    """All metrics as Prometheus text format 0.0.4."""
    c, stats = engine.scheduler.counters, engine.cache.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("tierkv_cache_hit_tokens_total", "counter", "Prompt tokens served from the cache, by tier.",
           [('{tier="L1"}', c.device_hit_tokens), ('{tier="L2"}', c.host_hit_tokens),
            ('{tier="L3"}', c.storage_hit_tokens)])
    metric("tierkv_evicted_tokens_total", "counter", "Tokens evicted from a tier.",
           [('{tier="L1"}', stats.evicted_device_tokens), ('{tier="L2"}', stats.evicted_host_tokens)])
    metric("tierkv_backed_up_tokens_total", "counter", "Tokens written from L1 to L2.",
           [("", stats.written_tokens)])
    metric("tierkv_loaded_back_tokens_total", "counter", "Tokens loaded from L2 back to L1.",
           [("", stats.loaded_tokens)])
    metric("tierkv_requests_total", "counter", "Requests by outcome.",
           [('{status="submitted"}', c.requests_submitted), ('{status="finished"}', c.requests_finished),
            ('{status="failed"}', c.requests_failed)])
    metric("tierkv_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", c.prompt_tokens)])
    metric("tierkv_generated_tokens_total", "counter", "Generated tokens.", [("", c.generated_tokens)])
    metric("tierkv_running_requests", "gauge", "Requests in the running batch.",
           [("", len(engine.scheduler.running))])
    metric("tierkv_waiting_requests", "gauge", "Requests waiting for admission.",
           [("", len(engine.scheduler.waiting))])
    metric("tierkv_device_free_slots", "gauge", "Free L1 token slots.", [("", engine.device_pool.num_free_slots)])
    ttft = sorted(c.ttft_s)
    metric("tierkv_ttft_seconds", "summary", "Time to first token.",
           [('{quantile="0.5"}', _quantile(ttft, 0.5)), ('{quantile="0.99"}', _quantile(ttft, 0.99))])
    lines.append(f"tierkv_ttft_seconds_sum {sum(ttft)}")
    lines.append(f"tierkv_ttft_seconds_count {len(ttft)}")
    return "\n".join(lines) + "\n"
