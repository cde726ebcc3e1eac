"""L3 storage tier: page stores keyed by chained page hashes, and the prefetch/backup workers."""
