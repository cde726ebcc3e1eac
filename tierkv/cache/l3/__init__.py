"""The L3 policy of the hierarchical cache: what works on tree nodes (prefetch into L2, backup from L2,
TP agreement on their progress, fetch-or-recompute costs). Page stores, the page format and the I/O
workers live in :mod:`tierkv.storage`, which knows nothing of the tree."""
