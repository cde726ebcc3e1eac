"""Exclusive tiers load back in chunks (``CacheConfig.load_chunk_tokens``) when the pages L1 demotes to
make room would not fit in L2's free room: each chunk is copied and promoted before the next makes room,
so the demotions take the loaded pages' L2 slots instead of L2 evicting as much as the load brings back.
A chunk whose copy fails or is interrupted ends the load there: what loaded is served, the rest stays in
L2, no slot leaks and no lock is left behind."""

import pytest
import torch

from tests.test_hicache import caches, put, same_bits  # noqa: F401 (caches: a fixture)
from tierkv.cache.config import CacheConfig
from tierkv.radix import RadixKey

A, B, C = list(range(16)), list(range(100, 116)), list(range(200, 216))


def full_tiers(caches, **cfg):
    """L1 16 tokens holding C, L2 32 tokens full with A and B (page 1), its staging (one chunk) free."""
    cache = caches(device_tokens=16, hicache_ratio=2.0, tier_mode="exclusive", load_back_threshold=0, **cfg)
    kv = {name: put(cache, tokens, seed=i) for i, (name, tokens) in enumerate(zip("ABC", (A, B, C)))}
    assert cache.host_pool.num_free_slots == cache.config.staging_tokens and cache.device_pool.num_free_slots == 0
    return cache, kv


def load(cache, tokens):
    match = cache.match_prefix(RadixKey(tokens))
    result = cache.init_load_back(match.last_host_node)
    assert result.pending is None or result.pending.wait()
    cache.flush()
    return result


def test_chunks_let_demotions_take_the_loaded_pages_l2_slots(caches):
    cache, kv = full_tiers(caches, load_chunk_tokens=4)
    result = load(cache, A)
    assert result.loaded_tokens == 16
    assert same_bits(cache.device_pool.read_tokens(result.device_indices), kv["A"])
    # the first chunk's demotions took the staging slots, the next ones the slots each chunk freed: L2
    # evicted nothing, as one tier of the same size would not (was 4: the first chunk's demotions)
    assert cache.stats.evicted_host_tokens == 0
    assert cache.host_pool.num_free_slots == 4  # the staging is free again
    assert cache.match_prefix(RadixKey(C)).host_hit_length == 16  # C: all of it in L2, demoted
    cache.check_integrity()
    c_loaded = load(cache, C)  # the demoted KV came through the swap intact
    assert same_bits(cache.device_pool.read_tokens(c_loaded.device_indices), kv["C"])
    cache.check_integrity()


def test_a_load_of_one_chunk_into_full_tiers_goes_through_the_staging(caches):
    """A's 16 tokens are one chunk: loaded at once, its demotions made L2 evict 16 tokens (the test
    before: one load evicts as much as it loads); through the staging, none."""
    cache, kv = full_tiers(caches, load_chunk_tokens=16)
    result = load(cache, A)
    assert result.pending is None and result.loaded_tokens == 16
    assert same_bits(cache.device_pool.read_tokens(result.device_indices), kv["A"])
    assert cache.stats.evicted_host_tokens == 0
    cache.check_integrity()
    c_loaded = load(cache, C)
    assert same_bits(cache.device_pool.read_tokens(c_loaded.device_indices), kv["C"])
    cache.check_integrity()


def test_a_chunked_load_splits_no_node(caches):
    cache, kv = full_tiers(caches, load_chunk_tokens=4)
    match = cache.match_prefix(RadixKey(A))
    [node] = [n for n in cache.tree.path_to_root(match.last_host_node)]
    result = load(cache, A)
    assert result.last_node is node and node.device_value is not None and node.host_value is None
    assert len(cache.tree.path_to_root(node)) == 1


def test_a_protected_node_keeps_its_l2_copy_through_a_chunked_load(caches):
    """An L3 backup reading A's L2 copy (host_ref) keeps it: A's slots are not freed chunk by chunk,
    so the demotions make L2 evict, but A's copy is whole afterwards."""
    cache, kv = full_tiers(caches, load_chunk_tokens=4)
    node = cache.match_prefix(RadixKey(A)).last_host_node
    cache.tree.inc_host_ref(node)
    result = load(cache, A)
    assert same_bits(cache.device_pool.read_tokens(result.device_indices), kv["A"])
    assert same_bits(cache.host_pool.read_tokens(node.host_value), kv["A"])  # both tiers hold A
    cache.tree.dec_host_ref(node)
    cache.check_integrity()


def test_one_load_makes_l2_evict_as_much_as_it_loads(caches):
    cache, kv = full_tiers(caches, load_chunk_tokens=0)
    result = load(cache, A)
    assert same_bits(cache.device_pool.read_tokens(result.device_indices), kv["A"])
    assert cache.stats.evicted_host_tokens == 16
    cache.check_integrity()


def test_no_chunks_when_l2_has_room_for_the_demotions(caches):
    cache = caches(device_tokens=16, hicache_ratio=4.0, tier_mode="exclusive", load_back_threshold=0,
                   load_chunk_tokens=4)
    kv_a = put(cache, A, seed=1)
    put(cache, B, seed=2)
    calls = []
    load_now = cache.transfer.load_now
    cache.transfer.load_now = lambda *a: calls.append(a) or load_now(*a)
    result = load(cache, A)
    assert calls == [] and result.loaded_tokens == 16  # one asynchronous load, as without chunks
    assert same_bits(cache.device_pool.read_tokens(result.device_indices), kv_a)
    assert cache.stats.evicted_host_tokens == 0
    cache.check_integrity()


def fail_call(run, number: int, error: BaseException):
    """``run``, except that call ``number`` (1-based) raises ``error`` instead of copying."""
    calls = []

    def run_or_fail(*args):
        calls.append(args)
        if len(calls) == number:
            raise error
        return run(*args)
    return run_or_fail


def test_a_failed_chunk_ends_the_load_and_serves_what_loaded(caches, monkeypatch):
    cache, kv = full_tiers(caches, load_chunk_tokens=4)
    copy = cache.transfer._cpu_copies["load"]
    monkeypatch.setattr(copy, "run_now", fail_call(copy.run_now, 2, RuntimeError("disk gone")))
    result = load(cache, A)
    assert result.pending is None and result.loaded_tokens == 4 and len(result.device_indices) == 4
    assert same_bits(cache.device_pool.read_tokens(result.device_indices), kv["A"][:, :, :4])
    assert cache.stats.failed_copies == 1
    assert cache.tree.protected_size == 0  # the path's lock went with the failed chunk
    assert cache.match_prefix(RadixKey(A)).host_hit_length == 12  # the rest stays in L2
    cache.check_integrity()
    monkeypatch.undo()
    rest = load(cache, A)  # and loads later
    assert same_bits(cache.device_pool.read_tokens(rest.device_indices), kv["A"])
    cache.check_integrity()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_chunk_propagates_without_a_leaked_slot_or_lock(caches, monkeypatch, interrupt):
    cache, kv = full_tiers(caches, load_chunk_tokens=4)
    copy = cache.transfer._cpu_copies["load"]
    monkeypatch.setattr(copy, "run_now", fail_call(copy.run_now, 3, interrupt()))
    match = cache.match_prefix(RadixKey(A))
    with pytest.raises(interrupt):
        cache.init_load_back(match.last_host_node)
    assert cache.tree.protected_size == 0
    cache.check_integrity()
    loaded = cache.match_prefix(RadixKey(A))
    assert len(loaded.device_indices) == 8 and loaded.host_hit_length == 8  # two chunks in, two in L2
    assert same_bits(cache.device_pool.read_tokens(loaded.device_indices), kv["A"][:, :, :8])


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_load_chunk_tokens_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="load_chunk_tokens"):
        CacheConfig(load_chunk_tokens=bad)


def test_replay_with_failing_chunks_serves_exact_kv_and_counts_each_tier(tmp_path, monkeypatch):
    """The whole path end to end (exclusive tiers, file L3, KV verified per request): every other chunk
    copy fails, so loads are cut short; what is served is still exact, and a short load's L2 and L3
    hits add up to what it loaded (L3's tokens end the host path)."""
    from tests.test_replay import FIXTURE
    from tierkv.replay.replay import ReplayConfig, TraceReplayer
    from tierkv.replay.trace import load_trace

    config = ReplayConfig(l1_tokens=6_144, l2_tokens=16_384, l3=f"file:{tmp_path}", verify=True,
                          tier_mode="exclusive", load_chunk_tokens=512)
    replayer = TraceReplayer(config)
    copy = replayer.cache.transfer._cpu_copies["load"]
    calls = []
    run_now = copy.run_now

    def fail_every_other(*args):
        calls.append(args)
        if len(calls) % 2 == 0:
            raise RuntimeError("copy engine reset")
        return run_now(*args)

    monkeypatch.setattr(copy, "run_now", fail_every_other)
    loads_now = []
    load_now = replayer.cache.transfer.load_now
    monkeypatch.setattr(replayer.cache.transfer, "load_now", lambda *a: loads_now.append(1) or load_now(*a))
    try:
        for req in load_trace(FIXTURE).requests[:120]:
            hits = replayer.serve(req)  # verify=True: wrong KV in a served prefix raises
            assert hits.l2 >= 0 and hits.l3 >= 0
            replayer.cache.check_integrity()
            assert replayer.cache.protected_size == 0
    finally:
        replayer.finish()
    assert loads_now and replayer.cache.stats.failed_copies > 0  # chunks ran, and some failed
