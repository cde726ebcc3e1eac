"""Configuration of the hierarchical cache: one frozen dataclass, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.eviction import POLICIES
from tierkv.pools.kv import HOST_LAYOUTS
from tierkv.copy.transfer import IO_BACKENDS
from tierkv.validate import check_bool, check_choice, check_int, check_number

WRITE_POLICIES = {"write_through": 1, "write_through_selective": 2, "write_back": None}
# inclusive: L2 keeps a copy of what L1 holds (per write_policy); exclusive: L2 keeps what L1 dropped
# (copied on L1 eviction, freed when loaded back), so L1 + L2 hold about as much as one tier of their size
TIER_MODES = ("inclusive", "exclusive")


def scaled_load_chunk_tokens(l1_tokens: int, page_size: int) -> int:
    """A load chunk (``CacheConfig.load_chunk_tokens``) for an L1 of ``l1_tokens``: 1/64 of it, 256 to 8192
    tokens, whole pages. A larger L1 loads longer prefixes, and a chunk costs a copy and a victim split
    whatever its size: on the shipped trace (L1 500k tokens) 2048- and 8192-token chunks gave the same hits
    as 256 for 0.62x and 0.57x the replay's CPU. The price is the staging: one chunk of L2 kept free (1.6 %
    of L1 at most). The engine and the replay size chunks with it; ``CacheConfig``'s default (256) is the
    smallest."""
    chunk = min(8192, max(256, l1_tokens // 64))
    return max(page_size, chunk // page_size * page_size)


@dataclass(frozen=True)
class CacheConfig:
    """Policies and sizes of the L1/L2 cache. Errors name the field and the bad value.

    ``hicache_size_gb`` (when not None or 0) overrides ``hicache_ratio``; ``enable_host=False`` gives a plain L1-only radix cache.
    """

    page_size: int = 1
    eviction_policy: str = "adaptive"  # chosen by measurement: docs/policies.md, "Defaults by measurement"
    write_policy: str = "write_through"
    io_backend: str = "kernel"
    host_layout: str = "layer_first"
    hicache_ratio: float = 2.0
    hicache_size_gb: float | None = None
    host_memory_reserve_gib: float = 10.0  # host memory an L2 must leave free, as HiCache's (0: none)
    load_back_threshold: int = 10
    bigram: bool = False
    enable_host: bool = True
    # exclusive: L1 + L2 hit as one tier of their total, where inclusive tiers trail it at every measured
    # point (docs/policies.md, "Defaults by measurement"); HiCache's is inclusive
    tier_mode: str = "exclusive"
    l2_admission: bool = False  # ask the eviction policy (Policy.admit) before copying a node to L2
    # an eviction takes only the pages it still needs from its last victim, splitting the node (False:
    # whole nodes, as HiCache evicts; README, "Eviction policies and tiers")
    split_victims: bool = True
    # exclusive tiers: a load back whose L1 demotions would not fit in L2's free room goes in chunks of
    # this many tokens (rounded down to whole pages, at least one), each copied, waited for and its L2
    # slots freed before the next makes room, so the demotions take the loaded pages' L2 slots instead
    # of L2 evicting as much as the load returns; L2 keeps one chunk free for the first chunk's
    # demotions (staging_tokens; tierkv.cache.chunked_load). 0: one asynchronous load, no staging
    load_chunk_tokens: int = 256
    # fetch from L3 / load from L2 only what is cheaper than recomputing it (tierkv.cache.l3.cost_model);
    # prefill_tokens_per_s fixes the prefill rate instead of measuring the engine's
    cost_aware: bool = True
    prefill_tokens_per_s: float | None = None
    # CPU pools: large L1 -> L2 writes run on a copy thread, overlapping the scheduler's next step (False:
    # on the caller's, for a caller that waits for them at once, as the trace replay does)
    overlap_cpu_writes: bool = True

    @property
    def staging_tokens(self) -> int:
        """L2 slots kept free at rest for exclusive chunked loads (one chunk): a chunk's L1 demotions go
        there while the chunk's own L2 slots still hold it, so L2 evicts nothing for them (a swap through
        one chunk of staging; tierkv.cache.chunked_load). 0 unless exclusive tiers load in chunks."""
        if self.tier_mode != "exclusive" or not self.load_chunk_tokens or not self.enable_host:
            return 0
        return max(self.page_size, self.load_chunk_tokens // self.page_size * self.page_size)

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, minimum=1)
        check_choice("eviction_policy", self.eviction_policy, sorted(POLICIES))
        check_choice("write_policy", self.write_policy, sorted(WRITE_POLICIES))
        check_choice("tier_mode", self.tier_mode, TIER_MODES)
        check_bool("l2_admission", self.l2_admission)
        check_bool("split_victims", self.split_victims)
        check_int("load_chunk_tokens", self.load_chunk_tokens, minimum=0)
        check_bool("cost_aware", self.cost_aware)
        check_bool("overlap_cpu_writes", self.overlap_cpu_writes)
        if self.prefill_tokens_per_s is not None:
            check_number("prefill_tokens_per_s", self.prefill_tokens_per_s, minimum=0, exclusive_minimum=True)
        check_choice("io_backend", self.io_backend, IO_BACKENDS)
        check_choice("host_layout", self.host_layout, HOST_LAYOUTS)
        check_number("hicache_ratio", self.hicache_ratio, minimum=0, exclusive_minimum=True)
        if self.hicache_size_gb is not None:  # 0, as in HiCache: no absolute size, use the ratio
            check_number("hicache_size_gb", self.hicache_size_gb, minimum=0)
        check_number("host_memory_reserve_gib", self.host_memory_reserve_gib, minimum=0)
        check_int("load_back_threshold", self.load_back_threshold, minimum=0)
        check_bool("bigram", self.bigram)
        check_bool("enable_host", self.enable_host)

    @property
    def write_threshold(self) -> int | None:
        """Hits after which a node is backed up to L2; None for write_back and exclusive (only on eviction)."""
        return None if self.tier_mode == "exclusive" else WRITE_POLICIES[self.write_policy]

    @property
    def writes_on_evict(self) -> bool:
        """An L1 eviction copies a node without an L2 copy to L2 first (write_back, or exclusive tiers)."""
        return self.write_threshold is None
