"""Assemble model, device pool, hierarchical cache and scheduler for one of the cache modes."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tierkv.cache.config import IO_BACKENDS, TIER_MODES, WRITE_POLICIES, CacheConfig, scaled_load_chunk_tokens
from tierkv.engine.config import ModelConfig
from tierkv.engine.loader import build_model, model_namespace
from tierkv.engine.models import CausalLM
from tierkv.engine.request import Request
from tierkv.engine.runner import ModelRunner
from tierkv.engine.scheduler import Scheduler, SchedulerConfig
from tierkv.eviction import POLICIES
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools.kv import HOST_LAYOUTS, DeviceKVPool
from tierkv.pools.spec import parse_dtype
from tierkv.validate import check_bool, check_choice, check_int, check_number, check_text

CACHE_MODES = ("none", "l1", "l1+l2", "l1+l2+l3")
MODE_LABELS = {"none": "no cache", "l1": "L1 only", "l1+l2": "L1+L2", "l1+l2+l3": "L1+L2+L3"}


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and policies of one engine. ``l3`` is a storage spec (e.g. ``file:/path``) for mode l1+l2+l3;
    ``storage_extra`` its extra config (prefetch policy, thresholds) as a dict. ``model_id`` (optional)
    is added to the model's L3 namespace, which always names the config and a digest of the weights."""

    mode: str = "l1+l2"
    device: str = "cpu"
    l1_tokens: int = 4096
    page_size: int = 1
    hicache_ratio: float = 2.0
    hicache_size_gb: float | None = None
    write_policy: str = "write_through"
    tier_mode: str = CacheConfig.tier_mode  # exclusive: L2 holds what L1 dropped; inclusive: a copy of L1
    eviction_policy: str = CacheConfig.eviction_policy
    host_layout: str = "layer_first"
    io_backend: str = "kernel"  # CacheConfig.io_backend: L1<->L2 copies (HiCache's --hicache-io-backend)
    kv_dtype: str | None = None
    l3: str | None = None
    storage_extra: dict | None = None
    max_running_requests: int = 16
    chunk_tokens: int = 256
    model_id: str | None = None
    layerwise_load: bool = True
    cost_aware: bool = True  # fetch/load only what beats recomputing (tierkv.cache.l3.cost_model)
    prefill_tokens_per_s: float | None = None  # fixes the prefill rate the cost model otherwise measures

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, CACHE_MODES)
        check_text("device", self.device, allow_empty=False)
        check_int("page_size", self.page_size, minimum=1)
        check_int("l1_tokens", self.l1_tokens, minimum=self.page_size)
        check_number("hicache_ratio", self.hicache_ratio, minimum=0, exclusive_minimum=True)
        if self.hicache_size_gb is not None:  # 0: use the ratio
            check_number("hicache_size_gb", self.hicache_size_gb, minimum=0)
        check_choice("write_policy", self.write_policy, sorted(WRITE_POLICIES))
        check_choice("tier_mode", self.tier_mode, TIER_MODES)
        check_choice("eviction_policy", self.eviction_policy, sorted(POLICIES))
        check_choice("host_layout", self.host_layout, HOST_LAYOUTS)
        check_choice("io_backend", self.io_backend, IO_BACKENDS)
        if self.kv_dtype is not None:
            try:
                parse_dtype(self.kv_dtype)
            except ValueError as exc:
                raise ValueError(f"kv_dtype: {exc}") from None
        if self.l3 is not None:
            check_text("l3", self.l3, secret=True)
        if self.mode == "l1+l2+l3" and not self.l3:
            raise ValueError("mode 'l1+l2+l3' needs l3 (a storage spec such as 'file:/path')")
        if self.storage_extra is not None and not isinstance(self.storage_extra, dict):
            raise ValueError(f"storage_extra must be a dict, got {type(self.storage_extra).__name__}")
        check_int("max_running_requests", self.max_running_requests, minimum=1)
        check_int("chunk_tokens", self.chunk_tokens, minimum=1)
        if self.model_id is not None:
            check_text("model_id", self.model_id, allow_empty=False)
        check_bool("layerwise_load", self.layerwise_load)
        check_bool("cost_aware", self.cost_aware)
        if self.prefill_tokens_per_s is not None:
            check_number("prefill_tokens_per_s", self.prefill_tokens_per_s, minimum=0, exclusive_minimum=True)


class Engine:
    """A model plus its cache and scheduler. ``generate`` is the blocking convenience API."""

    def __init__(self, model: CausalLM | ModelConfig | str, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.model = model if isinstance(model, CausalLM) else build_model(model, cfg.device)
        spec = self.model.config.kv_spec(cfg.kv_dtype)
        self.device_pool = DeviceKVPool(spec, cfg.l1_tokens, cfg.page_size, self.model.device)
        cache_cfg = CacheConfig(page_size=cfg.page_size, write_policy=cfg.write_policy, host_layout=cfg.host_layout,
                                io_backend=cfg.io_backend, tier_mode=cfg.tier_mode, eviction_policy=cfg.eviction_policy,
                                hicache_ratio=cfg.hicache_ratio, hicache_size_gb=cfg.hicache_size_gb,
                                enable_host=cfg.mode in ("l1+l2", "l1+l2+l3"), cost_aware=cfg.cost_aware,
                                prefill_tokens_per_s=cfg.prefill_tokens_per_s,
                                load_chunk_tokens=scaled_load_chunk_tokens(cfg.l1_tokens, cfg.page_size))
        self.cache = HiRadixCache(self.device_pool, cache_cfg)
        self.runner = ModelRunner(self.model, self.device_pool)
        self.scheduler = Scheduler(self.runner, self.cache, SchedulerConfig(
            cfg.max_running_requests, cfg.chunk_tokens, use_prefix_cache=cfg.mode != "none",
            layerwise_load=cfg.layerwise_load))
        if cfg.mode == "l1+l2+l3":
            from tierkv.engine.prefetch import attach_l3
            attach_l3(self, cfg.l3, cfg.storage_extra or {})

    @functools.cached_property
    def namespace(self) -> str:
        """Names the model in L3 keys: ``model_id``, the whole model config and a digest of the weights
        (the KV layout and dtype are added by the hash namespace). Computed once, when L3 is attached."""
        return model_namespace(self.model, self.config.model_id)

    def submit(self, prompt: list[int], max_new_tokens: int, **kwargs) -> Request:
        return self.scheduler.submit(Request(list(prompt), max_new_tokens, **kwargs))

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[Request]:
        """Run all prompts together (continuous batching) and return their finished requests."""
        requests = [self.submit(p, max_new_tokens) for p in prompts]
        while self.scheduler.has_work:
            self.scheduler.step()
        return requests

    def check_integrity(self) -> None:
        self.cache.check_integrity(caller_device_slots=self.scheduler.owned_device_slots())

    def close(self) -> None:
        self.cache.close()


def sync_device(device: torch.device | str) -> None:
    """Wait for queued kernels, so wall-clock timings cover the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
