"""A prefetch takes L2 room only for what L3 holds: lookup first, agree the count, then allocate.

Issue 16, target 3: a prefetch used to take host slots (evicting useful L2 data) for every page of the
prompt before asking L3, and then often found nothing.
"""

import threading

import pytest
import torch

from tests.storage_util import FakeStore, compute_and_insert, load_hit, make_cache, random_tokens
from tests.storage_util import storage_config
from tierkv.radix import RadixKey

PS = 16
KEY_PAGES = 8


class _GatedExists(FakeStore):
    """Its ``exists`` blocks while ``gate`` is shut."""

    def __init__(self, namespace: str, page_nbytes: int) -> None:
        super().__init__(namespace, page_nbytes)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def batch_exists(self, keys: list[str]) -> int:
        self.entered.set()
        assert self.gate.wait(30), "exists gate never opened"
        return super().batch_exists(keys)


def _full_l2_cache(stored_pages_of: RadixKey | None = None, **overrides):
    """L1 of 8 pages, L2 of 16 filled by two 8-page prompts (one host-only, one in both tiers); with
    ``stored_pages_of``, L3 holds that key first. Returns (cache, store, [(key, kv)] of the L2 prompts)."""
    cache = make_cache(page_size=PS, device_tokens=KEY_PAGES * PS, tier_mode="inclusive")
    assert cache.host_pool.num_pages == 2 * KEY_PAGES
    store = _GatedExists("test-ns", cache.host_pool.page_nbytes)
    config = dict(prefetch_max_tokens_in_flight=2 * KEY_PAGES * PS, prefetch_stop_policy="wait_complete",
                  io_wait_timeout_s=0.2)  # a reset gives up on the stuck lookup soon
    config.update(overrides)
    cache.attach_storage(store, storage_config(**config), "test-model")
    if stored_pages_of is not None:
        compute_and_insert(cache, stored_pages_of, seed=7)
        cache.flush()
        cache.evict(cache.device_pool.num_slots)
        cache.evict_host(cache.host_pool.num_slots)
    held = []
    for seed in (1, 2):
        key = RadixKey(random_tokens(KEY_PAGES * PS, seed=seed))
        held.append((key, compute_and_insert(cache, key, seed=seed + 10)))
        cache.flush()
    assert cache.host_pool.num_free_slots == 0
    return cache, store, held


def _l2_snapshot(cache) -> list[tuple[int, torch.Tensor]]:
    return [(n.id, n.host_value.clone()) for n in cache.tree.nodes() if n.host_value is not None]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(i == j and torch.equal(x, y) for (i, x), (j, y) in zip(a, b))


def test_a_prefetch_l3_has_nothing_for_takes_no_host_slot_and_evicts_nothing():
    cache, store, held = _full_l2_cache()
    before, evicted_before = _l2_snapshot(cache), cache.stats.evicted_host_tokens
    key = RadixKey(random_tokens(KEY_PAGES * PS, seed=3))  # L3 never saw it
    store.gate.clear()  # hold the lookup: nothing may be taken while it runs either
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    assert store.entered.wait(10)
    assert [len(s) for s in cache.storage.owned_host_slots()] == [0]
    assert _same(_l2_snapshot(cache), before)
    store.gate.set()
    cache.flush()
    assert cache.check_prefetch_progress("r")
    assert cache.storage.stats.prefetch_revoked == 1 and cache.storage.stats.prefetch_no_room == 0
    assert _same(_l2_snapshot(cache), before) and cache.stats.evicted_host_tokens == evicted_before
    assert cache.host_pool.num_free_slots == 0
    for key, kv in held:  # both prompts still hit in L1+L2, exact
        assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def test_a_prefetch_takes_host_slots_only_for_the_pages_l3_holds():
    stored_pages = 3
    key = RadixKey(random_tokens(KEY_PAGES * PS, seed=3))
    stored = RadixKey(key.token_ids[: stored_pages * PS])
    cache, store, _ = _full_l2_cache(stored_pages_of=stored)
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    prefetch = cache.storage.prefetches["r"]
    assert prefetch.exists_done.wait(10)
    cache.step()  # agrees what L3 holds and grants slots for that
    assert len(prefetch.host_slots) == stored_pages * PS
    cache.flush()
    assert cache.check_prefetch_progress("r")
    assert cache.stats.storage_hit_tokens == stored_pages * PS
    assert cache.match_prefix(key).host_hit_length == stored_pages * PS
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("end", ["release", "timeout", "reset"])
def test_a_prefetch_ended_during_its_lookup_leaks_nothing_and_reads_nothing(end):
    key = RadixKey(random_tokens(KEY_PAGES * PS, seed=3))
    cache, store, held = _full_l2_cache(stored_pages_of=key, prefetch_stop_policy="timeout",
                                        prefetch_timeout_base=3600.0 if end != "timeout" else 0.0)
    before = _l2_snapshot(cache)
    store.gate.clear()
    assert cache.prefetch_from_storage("r", cache.tree.root, key)
    prefetch = cache.storage.prefetches["r"]
    assert store.entered.wait(10)
    if end == "release":
        cache.release_prefetch("r")
    elif end == "timeout":
        cache.step()
        assert cache.check_prefetch_progress("r")  # the budget passed while exists was stuck
    else:
        cache.reset()
    cache.check_integrity()
    store.gate.set()  # the lookup returns: L3 holds every page, but the prefetch is over
    assert prefetch.finished.wait(10)
    cache.flush()
    assert len(prefetch.host_slots) == 0 and not prefetch.granted.is_set()
    assert not cache.storage.draining and cache.storage.owned_host_slots() == []
    assert cache.stats.storage_hit_tokens == 0
    if end != "reset":
        assert _same(_l2_snapshot(cache), before)
        assert cache.host_pool.num_free_slots == 0
    else:
        assert cache.host_pool.num_free_slots == cache.host_pool.num_slots
    cache.check_integrity()
    cache.close()
