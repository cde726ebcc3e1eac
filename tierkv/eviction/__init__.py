"""Eviction and admission policies for L1 and L2 (see :mod:`.base` for the interface)."""

from __future__ import annotations

from tierkv.eviction.adaptive import Adaptive
from tierkv.eviction.base import Policy, PolicyNode, depth_tokens, eviction_order, fingerprint
from tierkv.eviction.hitdensity import HitDensity
from tierkv.eviction.policies import ARC, FIFO, FILO, GDSF, LFU, LRU, MRU, S3FIFO, SLRU, CallerPriority, TinyLFU

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (LRU, MRU, FIFO, FILO, LFU, CallerPriority, SLRU, S3FIFO, ARC, TinyLFU, GDSF,
                                       HitDensity, Adaptive)
}


def get_policy(name: str) -> Policy:
    """A fresh instance of the policy named ``name`` (policies keep per-cache state); a ValueError lists
    the valid names otherwise."""
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None


__all__ = ["POLICIES", "Policy", "PolicyNode", "depth_tokens", "eviction_order", "fingerprint", "get_policy"]
