"""The hierarchical cache: the :class:`~tierkv.cache.hicache.HiRadixCache` facade and its parts (eviction,
loads, records, config) beside it, and the L3 policy in :mod:`tierkv.cache.l3`. The layers below (the tree,
the pools, the copies in :mod:`tierkv.copy`, the page stores in :mod:`tierkv.storage`) know nothing of it."""
