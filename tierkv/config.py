"""Configuration of the hierarchical cache: one frozen dataclass, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierkv.eviction import get_policy
from tierkv.pools.kv import HOST_LAYOUTS
from tierkv.transfer import IO_BACKENDS

WRITE_POLICIES = {"write_through": 1, "write_through_selective": 2, "write_back": None}
# inclusive: L2 keeps a copy of what L1 holds (per write_policy); exclusive: L2 keeps what L1 dropped
# (copied on L1 eviction, freed when loaded back), so L1 + L2 hold about as much as one tier of their size
TIER_MODES = ("inclusive", "exclusive")


@dataclass(frozen=True)
class CacheConfig:
    """Policies and sizes of the L1/L2 cache. Errors name the field and the bad value.

    ``hicache_size_gb`` overrides ``hicache_ratio``; ``enable_host=False`` gives a plain L1-only radix cache.
    """

    page_size: int = 1
    eviction_policy: str = "gdsf"  # chosen by measurement: README, "Eviction policies"
    write_policy: str = "write_through"
    io_backend: str = "kernel"
    host_layout: str = "layer_first"
    hicache_ratio: float = 2.0
    hicache_size_gb: float | None = None
    load_back_threshold: int = 10
    bigram: bool = False
    enable_host: bool = True
    tier_mode: str = "inclusive"
    l2_admission: bool = False  # ask the eviction policy (Policy.admit) before copying a node to L2

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        get_policy(self.eviction_policy)
        _choice("write_policy", self.write_policy, sorted(WRITE_POLICIES))
        _choice("tier_mode", self.tier_mode, TIER_MODES)
        if not isinstance(self.l2_admission, bool):
            raise TypeError(f"l2_admission must be a bool, got {self.l2_admission!r}")
        _choice("io_backend", self.io_backend, IO_BACKENDS)
        _choice("host_layout", self.host_layout, HOST_LAYOUTS)
        _positive_number("hicache_ratio", self.hicache_ratio)
        if self.hicache_size_gb is not None:
            _positive_number("hicache_size_gb", self.hicache_size_gb)
        if not isinstance(self.load_back_threshold, int) or self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be an int >= 0, got {self.load_back_threshold!r}")

    @property
    def write_threshold(self) -> int | None:
        """Hits after which a node is backed up to L2; None for write_back and exclusive (only on eviction)."""
        return None if self.tier_mode == "exclusive" else WRITE_POLICIES[self.write_policy]

    @property
    def writes_on_evict(self) -> bool:
        """An L1 eviction copies a node without an L2 copy to L2 first (write_back, or exclusive tiers)."""
        return self.write_threshold is None


def _choice(name: str, value: object, options) -> None:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} {value!r} is not one of {list(options)}")


def _positive_number(name: str, value: object) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
