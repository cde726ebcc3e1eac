"""Bad allocations and inserts are refused before anything changes (issue 11, item 6).

Random good calls (inserts, evictions) build up a tree; random bad calls in between must raise
ValueError/TypeError and leave the tree, the pools and the stats exactly as they were.
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.storage_util import make_cache
from tierkv.radix import RadixKey

PREFIXES = [[7] * 8, [1, 2, 3, 4] * 4, [9, 8] * 12]
BAD_INSERTS = ["out_of_range", "negative", "unallocated", "repeated", "misaligned", "short", "int32",
               "float", "2d"]


def _values(v):
    return None if v is None else v.tolist()


def snapshot(cache):
    """Everything a call may change: every node's fields, the clock, the pools' ownership, the stats."""
    nodes = sorted((n.id, tuple(n.key), n.extra_key, n.parent.id, _values(n.device_value), _values(n.host_value),
                    n.lock_ref, n.host_ref, n.hit_count, n.last_access_time, n.priority, n.hash_values,
                    getattr(n, "invalid", False)) for n in cache.tree.nodes())
    pools = [(p.allocator.num_free_slots, p.allocator.owned_mask().tolist())
             for p in (cache.device_pool, cache.host_pool)]
    tree = (cache.tree._tick, cache.tree.evictable_size, cache.tree.protected_size)
    return nodes, pools, tree, dataclasses.asdict(cache.stats)


def _key(data, page_size: int) -> RadixKey:
    prefix = data.draw(st.sampled_from(PREFIXES))
    suffix = data.draw(st.lists(st.integers(0, 50), max_size=3 * page_size))
    return RadixKey(prefix + suffix)


def _request_slots(cache, key: RadixKey):
    """As a scheduler builds them: the tree's own slots for the device hit, fresh ones for the rest
    (rounded up to whole pages); (all slots, the fresh ones), or None when L1 has no room."""
    ps = cache.config.page_size
    prefix = cache.match_prefix(key).device_indices
    num_new = -(-(len(key) - len(prefix)) // ps) * ps
    fresh = cache.alloc_device(num_new)
    if fresh is None:
        return None
    return torch.cat([prefix, fresh]), fresh


def _corrupt(cache, kind: str, slots: torch.Tensor, fresh: torch.Tensor, num_elems: int, data):
    """``slots`` made bad in one way ``kind`` names; None when this state cannot show that kind."""
    pool, ps = cache.device_pool, cache.config.page_size
    bad = slots[:num_elems].clone()
    if num_elems == 0 and kind not in ("int32", "float", "2d"):
        return None
    page = data.draw(st.integers(0, max(num_elems // ps - 1, 0)))
    where = slice(page * ps, (page + 1) * ps)
    if kind == "out_of_range":
        bad[where] = torch.arange(pool.num_slots, pool.num_slots + ps)
    elif kind == "negative":
        bad[where] = torch.arange(-ps, 0)
    elif kind == "unallocated":
        free = torch.nonzero(~pool.allocator.owned_mask()).flatten()
        if len(free) == 0:
            return None
        bad[where] = free[0] * ps + torch.arange(ps)
    elif kind == "repeated":
        if num_elems < 2 * ps:
            return None
        other = (page + 1) % (num_elems // ps)
        bad[where] = bad[other * ps:(other + 1) * ps].clone()
    elif kind == "misaligned":
        if ps == 1:
            return None
        bad[where] = bad[where] + 1
    elif kind == "short":
        bad = bad[:num_elems - ps]
    elif kind == "int32":
        bad = bad.to(torch.int32)
    elif kind == "float":
        bad = bad.to(torch.float32)
    elif kind == "2d":
        bad = bad.view(1, -1)
    return bad


def _bad_alloc(cache, data) -> None:
    ps = cache.config.page_size
    alloc = data.draw(st.sampled_from([cache.alloc_device, cache.alloc_host]))
    num_tokens = data.draw(st.sampled_from([-ps, -2 * ps, -cache.device_pool.num_slots, True, 1.5, "16"]
                                           + ([ps + 1, 2 * ps - 1] if ps > 1 else [])))
    before = snapshot(cache)
    with pytest.raises((ValueError, TypeError)):
        alloc(num_tokens)
    assert snapshot(cache) == before
    cache.check_integrity()


def _bad_insert(cache, data) -> None:
    key = _key(data, cache.config.page_size)
    if (got := _request_slots(cache, key)) is None:
        return
    slots, fresh = got
    kind = data.draw(st.sampled_from(BAD_INSERTS))
    bad = _corrupt(cache, kind, slots, fresh, len(cache.tree.elements(key)), data)
    if bad is not None:
        before = snapshot(cache)
        with pytest.raises((ValueError, TypeError)):
            cache.insert(key, bad)
        assert snapshot(cache) == before, kind
        cache.check_integrity(caller_device_slots=fresh)
    cache.device_pool.free(fresh)


def _good_insert(cache, data) -> None:
    key = _key(data, cache.config.page_size)
    if (got := _request_slots(cache, key)) is None:
        return
    owned = cache.insert(key, got[0])
    slots = got[0]
    cache.device_pool.free(slots[owned:])
    cache.flush()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 4]), data=st.data())
def test_bad_calls_change_nothing(page_size, data):
    cache = make_cache(page_size=page_size, device_tokens=96)
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["good", "good", "evict", "bad_alloc", "bad_insert", "bad_insert"]))
        if op == "good":
            _good_insert(cache, data)
        elif op == "evict":
            cache.evict(data.draw(st.integers(0, 64)))
        elif op == "bad_alloc":
            _bad_alloc(cache, data)
        else:
            _bad_insert(cache, data)
        cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("num_tokens", [-16, -32])
def test_negative_alloc_is_refused(num_tokens):
    cache = make_cache(page_size=16)
    free = (cache.device_pool.num_free_slots, cache.host_pool.num_free_slots)
    for alloc in (cache.alloc_device, cache.alloc_host, cache.device_pool.alloc):
        with pytest.raises(ValueError, match="num_tokens"):
            alloc(num_tokens)
    assert (cache.device_pool.num_free_slots, cache.host_pool.num_free_slots) == free
    cache.check_integrity()
    cache.close()
