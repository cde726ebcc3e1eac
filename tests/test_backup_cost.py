"""Backups the cost model refuses (tierkv.cache.l3.cost_model.backup_worth_writing): queued as done like a
rank that does not write, retired in order, nothing written, host pages released; every
BACKUP_PROBE_EVERY-th refusal writes one get batch of its leading pages (a probe)."""

from tests.storage_util import attach_fake, compute_and_insert, make_cache, random_tokens
from tierkv.cache.l3 import cost_model
from tierkv.radix import RadixKey

BACKUP_PROBE_EVERY = getattr(cost_model, "BACKUP_PROBE_EVERY", 32)
PS = 16
PAGES = 4
PROBE_PAGES = 2


def test_refused_backups_write_nothing_and_release_their_pages():
    # recompute at 1e12 tokens/s: no page is worth any write once a write has been measured
    num_tokens = (BACKUP_PROBE_EVERY + 1) * PAGES * PS  # L1 holds every key: nothing is evicted meanwhile
    cache = make_cache(page_size=PS, device_tokens=num_tokens, prefill_tokens_per_s=1e12)
    store = attach_fake(cache, prefetch_batch_pages=PROBE_PAGES)
    keys = [RadixKey(random_tokens(PAGES * PS, seed=100 + i)) for i in range(BACKUP_PROBE_EVERY + 1)]
    compute_and_insert(cache, keys[0], seed=1)
    cache.flush()
    cache.step()
    assert len(store.blobs) == PAGES  # the first write is made: its cost is not known before
    for i, key in enumerate(keys[1:BACKUP_PROBE_EVERY], start=1):
        compute_and_insert(cache, key, seed=1 + i)
        cache.flush()
        cache.step()
        cache.check_integrity()
    stats = cache.storage.stats
    assert len(store.blobs) == PAGES and not cache.storage.backups  # refused ones were retired
    assert stats.backup_not_worth_tokens == (BACKUP_PROBE_EVERY - 1) * PAGES * PS
    assert cache.cost_model.skipped_backups == BACKUP_PROBE_EVERY - 1
    compute_and_insert(cache, keys[-1], seed=99)  # the BACKUP_PROBE_EVERY-th refusal: a probe
    cache.flush()
    cache.step()
    assert len(store.blobs) == PAGES + PROBE_PAGES
    hashes = cache.storage.path_hashes(cache.match_prefix(keys[-1]).last_host_node)
    assert store.batch_exists(hashes) == PROBE_PAGES  # the leading pages: a readable prefix
    cache.evict(cache.device_pool.num_slots)  # no host_ref left behind: every L2 page can go
    assert cache.evict_host(cache.host_pool.num_slots) == len(keys) * PAGES * PS
    cache.check_integrity()
    cache.close()


def test_without_a_prefill_rate_every_backup_is_written():
    cache = make_cache(page_size=PS)  # no engine reports passes: the cost model knows no prefill rate
    store = attach_fake(cache)
    for i in range(3):
        compute_and_insert(cache, RadixKey(random_tokens(PAGES * PS, seed=200 + i)), seed=i)
        cache.flush()
        cache.step()
    assert len(store.blobs) == 3 * PAGES and cache.storage.stats.backup_not_worth_tokens == 0
    cache.close()
