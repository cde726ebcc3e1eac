"""CacheConfig: every bad value is a ValueError naming the field and the value."""

import pytest
import torch

from tierkv.cache.config import CacheConfig
from tierkv.pools import DeviceKVPool, KVSpec
from tierkv.cache.hicache import HiRadixCache


def test_defaults_are_valid():
    cfg = CacheConfig()
    assert cfg.eviction_policy == "adaptive" and cfg.tier_mode == "exclusive" and cfg.write_policy == "write_through"
    assert cfg.write_threshold is None  # exclusive tiers copy to L2 on eviction; L3 backups follow write_policy
    assert CacheConfig(tier_mode="inclusive").write_threshold == 1
    assert CacheConfig(write_policy="write_through_selective", tier_mode="inclusive").write_threshold == 2
    assert CacheConfig(write_policy="write_back", tier_mode="inclusive").write_threshold is None


@pytest.mark.parametrize("field,value", [
    ("eviction_policy", "random"),
    ("eviction_policy", None),
    ("write_policy", "write_around"),
    ("io_backend", "dma"),
    ("host_layout", "page_last"),
    ("page_size", 0),
    ("page_size", -4),
    ("page_size", 2.0),
    ("page_size", True),
    ("hicache_ratio", 0),
    ("hicache_ratio", -1.5),
    ("hicache_ratio", "2"),
    ("hicache_size_gb", -3),
    ("hicache_size_gb", "8"),
    ("load_back_threshold", -1),
    ("load_back_threshold", 1.5),
    ("overlap_cpu_writes", 0),
])
def test_bad_value_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError) as err:
        CacheConfig(**{field: value})
    assert repr(value) in str(err.value)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        CacheConfig().page_size = 4  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_layers=0, kv_heads=1, head_dim=1), "num_layers"),
    (dict(num_layers=1, kv_heads=0, head_dim=1), "kv_heads"),
    (dict(num_layers=1, kv_heads=1, head_dim=-2), "-2"),
    (dict(num_layers=1, attention="gqa"), "'gqa'"),
    (dict(num_layers=1, attention="mla", kv_lora_rank=0), "kv_lora_rank"),
    (dict(num_layers=1, attention="mla", kv_lora_rank=4, rope_dim=-1), "rope_dim"),
    (dict(num_layers=1, kv_heads=1, head_dim=1, dtype="float17"), "float17"),
    (dict(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.complex64), "complex64"),
])
def test_bad_kv_spec_is_a_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        KVSpec(**kwargs)


def test_cache_rejects_mismatched_sizes():
    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=2)
    with pytest.raises(ValueError, match="page_size 4"):
        HiRadixCache(DeviceKVPool(spec, 16, 4, "cpu"), CacheConfig(page_size=1))
    with pytest.raises(ValueError, match="hicache_ratio=0.5"):
        HiRadixCache(DeviceKVPool(spec, 16, 1, "cpu"), CacheConfig(hicache_ratio=0.5))
    with pytest.raises(ValueError, match="not larger"):
        HiRadixCache(DeviceKVPool(spec, 16, 1, "cpu"), CacheConfig(hicache_size_gb=1e-7))


def test_the_replay_and_the_engine_scale_load_chunks_with_l1():
    # 256-token chunks made a replay of the shipped trace (L1 500k) spend two fifths of its CPU on chunk
    # copies and victim splits; chunks scale with L1 now, from 256 up to 8192 tokens, in whole pages
    from tierkv.cache.config import scaled_load_chunk_tokens
    from tierkv.replay.replay import ReplayConfig

    assert scaled_load_chunk_tokens(512, 16) == 256 and scaled_load_chunk_tokens(10**8, 16) == 8192
    assert scaled_load_chunk_tokens(500_000, 16) == 7808 and scaled_load_chunk_tokens(100_000, 512) == 1536
    assert scaled_load_chunk_tokens(1024, 512) == 512  # at least one page
    assert ReplayConfig(l1_tokens=500_000, l2_tokens=4_500_000).cache_config().load_chunk_tokens == 7808
    unchunked = ReplayConfig(l1_tokens=500_000, l2_tokens=4_500_000, load_chunk_tokens=0)
    assert unchunked.cache_config().load_chunk_tokens == 0
    assert CacheConfig().load_chunk_tokens == 256
