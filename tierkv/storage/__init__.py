"""L3 storage tier: page stores keyed by chained page hashes (the L3 policy over tree nodes is tierkv.cache)."""
