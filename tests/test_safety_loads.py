"""A failed L2 -> L1 load is never matchable, even while its nodes stay locked (issue 11, item 3)."""

import threading

import torch

from tests.storage_util import compute_and_insert, load_hit, make_cache, random_tokens
from tierkv.radix import RadixKey

PS = 16
GARBAGE = 7.0


def _host_only_key(cache, num_pages: int = 4):
    """A key whose KV is in L2 only, and L1 filled with a pattern no inserted KV has."""
    key = RadixKey(random_tokens(num_pages * PS, seed=1))
    kv = compute_and_insert(cache, key, seed=2)
    cache.flush()
    cache.evict(cache.device_pool.num_slots)
    assert all(n.device_value is None for n in cache.tree.nodes())
    cache.device_pool.buffer.fill_(GARBAGE)  # what a failed load leaves in its slots
    return key, kv


def _assert_no_garbage_hit(cache, key: RadixKey, kv: torch.Tensor) -> None:
    m = cache.match_prefix(key)
    got = cache.device_pool.read_tokens(m.device_indices)
    assert torch.equal(got, kv[:, :, :got.shape[2]])
    assert not m.last_host_node.invalid


def _random_kv(cache, num_tokens: int) -> torch.Tensor:
    spec = cache.device_pool.spec
    return torch.randn(spec.num_kv, spec.num_layers, num_tokens, spec.heads, spec.dim).to(spec.dtype)


def _assert_dropped_and_reloaded(cache, key: RadixKey, kv: torch.Tensor) -> None:
    """No invalid node is left; with copies working again, the prefix loads back exactly from L2."""
    assert not any(n.invalid for n in cache.tree.nodes())
    cache.check_integrity()
    cache.transfer.delay_hook = None
    assert torch.equal(load_hit(cache, key), kv)
    cache.check_integrity()
    cache.close()


def _gated_copies(cache):
    """Copies block until their kind's gate opens; loads then fail."""
    gates = {"load": threading.Event(), "write": threading.Event()}

    def hook(kind: str) -> None:
        assert gates[kind].wait(30)
        if kind == "load":
            raise RuntimeError("injected load failure")

    cache.transfer.delay_hook = hook
    return gates


def test_failed_load_with_write_through_in_flight_at_retirement():
    cache = make_cache(page_size=PS, tier_mode="inclusive")
    key, kv = _host_only_key(cache)
    gates = _gated_copies(cache)
    m = cache.match_prefix(key)
    load = cache.init_load_back(m.last_host_node)
    assert load.pending is not None
    # the request goes on before its load ends: it inserts its prompt plus 2 pages; the write-through
    # of the new pages locks the loaded nodes
    longer = RadixKey(list(key.token_ids) + random_tokens(2 * PS, seed=3))
    new = cache.alloc_device(2 * PS)
    tail = _random_kv(cache, 2 * PS)
    cache.device_pool.write_tokens(new, tail)
    assert cache.insert(longer, torch.cat([load.device_indices, new])) == len(longer)
    gates["load"].set()
    assert not load.pending.wait()
    cache.step()  # retires the failed load; the write still holds the lock
    assert cache.transfer.writes
    _assert_no_garbage_hit(cache, key, kv)
    _assert_no_garbage_hit(cache, longer, torch.cat([kv, tail], dim=2))
    cache.check_integrity()
    gates["write"].set()
    cache.flush()  # the write retires: the invalid nodes are unlocked, so dropped
    _assert_dropped_and_reloaded(cache, key, kv)


def test_failed_load_kept_locked_by_a_careless_caller_then_insert():
    cache = make_cache(page_size=PS)
    key, kv = _host_only_key(cache)
    gates = _gated_copies(cache)
    gates["load"].set()
    gates["write"].set()
    m = cache.match_prefix(key)
    load = cache.init_load_back(m.last_host_node)
    cache.inc_lock_ref(load.last_node)  # keeps its lock though wait() says the KV is garbage
    assert not load.pending.wait()
    cache.flush()
    _assert_no_garbage_hit(cache, key, kv)
    cache.check_integrity()
    # another request computed the prompt itself and inserts it, plus 2 pages
    longer = RadixKey(list(key.token_ids) + random_tokens(2 * PS, seed=3))
    slots = cache.alloc_device(len(longer))
    fresh = _random_kv(cache, 2 * PS)
    cache.device_pool.write_tokens(slots, torch.cat([kv, fresh], dim=2))
    owned = cache.insert(longer, slots)
    cache.device_pool.free(slots[owned:])
    cache.flush()
    _assert_no_garbage_hit(cache, key, kv)
    _assert_no_garbage_hit(cache, longer, torch.cat([kv, fresh], dim=2))
    cache.check_integrity()
    cache.dec_lock_ref(load.last_node)  # the lock goes: the garbage goes with it
    _assert_dropped_and_reloaded(cache, key, kv)
