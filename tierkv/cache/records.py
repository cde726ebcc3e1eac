"""Records of the hierarchical cache: lookup and load results, statistics, and in-flight copies.

In-flight work is an object that owns its slots and its node locks (see each record's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from tierkv.radix import TreeNode
from tierkv.copy.transfer import CopyHandle

if TYPE_CHECKING:
    from tierkv.cache.l3.backup import Backup


@dataclass
class MatchResult:
    """What a prefix lookup found: the L1 part (usable now) and the L2 part behind it."""

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int


@dataclass
class CacheStats:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    written_tokens: int = 0
    loaded_tokens: int = 0
    write_skipped_tokens: int = 0
    failed_copies: int = 0

    def clear(self) -> None:
        """Back to zero in place: the cache's parts hold this object."""
        for f in fields(self):
            setattr(self, f.name, f.default)


@dataclass
class PendingWrite:
    """An L1 -> L2 backup in flight: ``node``'s path is locked (L1) and protected (L2) until it completes.

    With ``backup`` (exclusive tiers), a copy for an L3 backup alone: ``host_slots`` are its own, not the
    tree's, and ``node``'s path is locked but not protected."""

    node: TreeNode
    host_slots: torch.Tensor
    num_tokens: int
    backup: Backup | None = None


@dataclass
class PendingLoad:
    """An L2 -> L1 load in flight: ``node``'s path is locked and protected until it completes."""

    node: TreeNode
    device_slots: torch.Tensor
    handle: CopyHandle | None  # None while deferred (init_load_back(defer=True) until start_loading)
    failed: bool = False  # seen failed: its nodes are marked invalid

    def wait(self) -> bool:
        """Block until the KV is in L1; False if the copy failed (its slots hold no valid KV)."""
        if self.handle is None:
            raise RuntimeError("this load was deferred and is not started: call HiRadixCache.start_loading()")
        self.handle.wait()
        return self.handle.error is None


@dataclass
class _WriteBackBatch:
    """Write-backs of one eviction pass: copied in one batch, then the evicted device slots are freed."""

    device_slots: list[torch.Tensor] = field(default_factory=list)
    host_slots: list[torch.Tensor] = field(default_factory=list)
    protected: list[TreeNode] = field(default_factory=list)  # given host slots; host_ref held until the copy ends
    # (node, its device slots): freed after the copy; None once a failed copy put them back on the node
    evicted: list[tuple[TreeNode, torch.Tensor | None]] = field(default_factory=list)
    raised: BaseException | None = None  # by the copy (an interrupt): re-raised once the pass is settled


@dataclass
class LoadResult:
    """Outcome of :meth:`HiRadixCache.init_load_back`: the device indices of the whole usable prefix."""

    device_indices: torch.Tensor
    last_node: TreeNode
    pending: PendingLoad | None = None
    loaded_tokens: int = 0
