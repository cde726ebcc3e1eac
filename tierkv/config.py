"""Configuration of the hierarchical cache: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.eviction import get_policy
from tierkv.pools.kv import HOST_LAYOUTS
from tierkv.transfer import IO_BACKENDS

WRITE_POLICIES = {"write_through": 1, "write_through_selective": 2, "write_back": None}


@dataclass(frozen=True)
class CacheConfig:
    """Policies and sizes of the L1/L2 cache. Errors name the field and the bad value.

    ``hicache_size_gb`` overrides ``hicache_ratio``; ``enable_host=False`` gives a plain L1-only radix cache.
    """

    page_size: int = 1
    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    io_backend: str = "kernel"
    host_layout: str = "layer_first"
    hicache_ratio: float = 2.0
    hicache_size_gb: float | None = None
    load_back_threshold: int = 10
    bigram: bool = False
    enable_host: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        get_policy(self.eviction_policy)
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {self.write_policy!r} is not one of {sorted(WRITE_POLICIES)}")
        if self.io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend {self.io_backend!r} is not one of {IO_BACKENDS}")
        if self.host_layout not in HOST_LAYOUTS:
            raise ValueError(f"host_layout {self.host_layout!r} is not one of {HOST_LAYOUTS}")
        if not isinstance(self.hicache_ratio, (int, float)) or self.hicache_ratio <= 0:
            raise ValueError(f"hicache_ratio must be a positive number, got {self.hicache_ratio!r}")
        if self.hicache_size_gb is not None and (
                not isinstance(self.hicache_size_gb, (int, float)) or self.hicache_size_gb <= 0):
            raise ValueError(f"hicache_size_gb must be a positive number, got {self.hicache_size_gb!r}")
        if not isinstance(self.load_back_threshold, int) or self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be an int >= 0, got {self.load_back_threshold!r}")

    @property
    def write_threshold(self) -> int | None:
        """Hits after which a node is backed up to L2; None for write_back (only on eviction)."""
        return WRITE_POLICIES[self.write_policy]
