"""The hierarchical cache: the :class:`~tierkv.cache.hicache.HiRadixCache` facade and its parts (eviction,
loads, records, config) beside it, and the L3 policy in :mod:`tierkv.cache.l3`. The layers below (the tree,
the pools, the copies in :mod:`tierkv.copy`, the page stores in :mod:`tierkv.storage`) know nothing of it."""

import importlib

# The names an engine needs, importable from the package itself (``from tierkv.cache import HiRadixCache``).
# Looked up on first use, so importing one part (tierkv.cache.config, say) does not import the facade.
_EXPORTS = {
    "HiRadixCache": "tierkv.cache.hicache",
    "CacheConfig": "tierkv.cache.config",
    "CacheStats": "tierkv.cache.records",
    "MatchResult": "tierkv.cache.records",
    "LoadResult": "tierkv.cache.records",
    "open_storage": "tierkv.cache.l3.controller",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
