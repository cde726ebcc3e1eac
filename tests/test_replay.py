from pathlib import Path

import pytest

from tierkv.replay.optimal import belady_min
from tierkv.replay.replay import ReplayConfig, TraceReplayer, prompt_key, replay
from tierkv.replay.trace import TraceRequest, load_trace

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_200.jsonl"


@pytest.fixture(scope="module")
def requests():
    return load_trace(FIXTURE).requests


def reference_hits(requests, page_size, include_output=False):
    """An independent model: a nested dict of whole pages; a hit is the longest cached page prefix."""
    trie, hits = {}, []
    for req in requests:
        prompt = req.prompt_tokens()
        node, hit = trie, 0
        for i in range(0, len(prompt) // page_size * page_size, page_size):
            page = tuple(prompt[i:i + page_size])
            if page not in node:
                break
            node, hit = node[page], hit + page_size
        hits.append(hit)
        inserted = prompt + req.output_tokens() if include_output else prompt
        node = trie
        for i in range(0, len(inserted) // page_size * page_size, page_size):
            node = node.setdefault(tuple(inserted[i:i + page_size]), {})
    return hits


@pytest.mark.parametrize("config", [
    ReplayConfig(l1_tokens=1_000_000, verify=True),  # L1 only, never evicts
    ReplayConfig(l1_tokens=8_192, l2_tokens=1_000_000, verify=True),  # small L1: most hits come from L2
    ReplayConfig(l1_tokens=8_192, l2_tokens=1_000_000, page_size=7, write_policy="write_back", verify=True),
    ReplayConfig(l1_tokens=1_000_000, include_output=True),
], ids=["l1", "l1+l2", "l1+l2-page7-write_back", "include_output"])
def test_unbounded_replay_equals_reference(requests, config):
    result = replay(requests, config)
    expected = reference_hits(requests, config.page_size, config.include_output)
    assert [r.hit_tokens for r in result.requests] == expected
    if config.l2_tokens:
        assert result.tier_hits()["l2"] > result.tier_hits()["l1"] > 0
    assert result.uncached_requests == 0


def test_replay_with_l3_hits_only_what_was_seen_and_delivers_exact_kv(requests, tmp_path):
    config = ReplayConfig(l1_tokens=6_144, l2_tokens=16_384, l3=f"file:{tmp_path}", verify=True)
    result = replay(requests[:120], config)
    expected = reference_hits(requests[:120], 16)
    got = [r.hit_tokens for r in result.requests]
    assert all(g <= e for g, e in zip(got, expected))
    hits = result.tier_hits()
    assert hits["l3"] > hits["l2"] > 0 and hits["l1"] > 0
    # L3 never evicts, so only prefixes under the 256-token prefetch threshold are lost
    assert sum(got) >= 0.95 * sum(expected)
    assert result.prefetched_l3_l2_tokens == hits["l3"] and result.backed_up_l2_l3_tokens > 0


@pytest.mark.parametrize("l1, l2, policy, write_policy", [
    (6_144, 16_384, "lru", "write_through"),
    (6_144, 40_000, "lfu", "write_through_selective"),
    (12_288, 30_000, "fifo", "write_back"),
    (30_000, None, "lru", "write_through"),
    (6_144, None, "mru", "write_through"),
])
def test_bounded_hit_ratio_never_exceeds_optimal(requests, l1, l2, policy, write_policy):
    config = ReplayConfig(l1_tokens=l1, l2_tokens=l2, eviction_policy=policy, write_policy=write_policy)
    result = replay(requests, config)
    optimal = belady_min(requests, config.total_tokens, config.page_size)
    assert 0 < result.hit_ratio <= optimal.hit_ratio
    assert sum(r.hit_tokens for r in result.requests) <= optimal.hit_tokens


def test_every_step_keeps_the_cache_consistent(requests):
    replayer = TraceReplayer(ReplayConfig(l1_tokens=4_096, l2_tokens=12_288, verify=True))
    try:
        for req in requests[:60]:
            replayer.serve(req)
            replayer.cache.check_integrity()
            assert replayer.cache.protected_size == 0
    finally:
        replayer.finish()


def test_request_longer_than_l1_is_served_uncached():
    big = TraceRequest(0, 1, 0, 3_000, 0, tuple(range(6)))
    result = replay([big, big], ReplayConfig(l1_tokens=1_024, l2_tokens=4_096))
    assert result.uncached_requests == 2
    assert [r.hit_tokens for r in result.requests] == [0, 0]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="l2_tokens"):
        ReplayConfig(l1_tokens=1_000, l2_tokens=500)
    with pytest.raises(ValueError, match="l1_tokens"):
        ReplayConfig(l1_tokens=8)
    with pytest.raises(ValueError, match="needs an L2"):
        ReplayConfig(l1_tokens=1_024, l3="memory")
    with pytest.raises(ValueError, match="eviction.policy"):
        ReplayConfig(l1_tokens=1_024, eviction_policy="nope")


@pytest.mark.parametrize("row", [0, 1])  # K, then V
def test_verify_catches_wrong_kv_in_a_reused_prefix(row):
    """verify writes each new token's id as its K and V and reads every reused prefix back: one wrong
    value in either row of L1 fails the next request that reuses it."""
    req = TraceRequest(0, 1, 0, 1_024, 0, (7, 8))
    replayer = TraceReplayer(ReplayConfig(l1_tokens=4_096, l2_tokens=12_288, verify=True))
    try:
        replayer.serve(req)
        slots = replayer.cache.match_prefix(prompt_key(req.prompt_array())).device_indices
        assert len(slots) == 1_024
        replayer.kv_rows[row, slots[600]] += 1
        with pytest.raises(AssertionError, match=r"positions \[600\]"):
            replayer.serve(req)
    finally:
        replayer.finish()


def test_verify_refuses_reused_slots_that_are_not_whole_aligned_pages():
    """verify reads K/V by page, so it first checks the slots are whole aligned pages: a prefix whose
    page is shifted by one slot is an error, never a page read from the wrong place."""
    req = TraceRequest(0, 1, 0, 1_024, 0, (7, 8))
    replayer = TraceReplayer(ReplayConfig(l1_tokens=4_096, l2_tokens=12_288, verify=True))
    try:
        replayer.serve(req)
        slots = replayer.cache.match_prefix(prompt_key(req.prompt_array())).device_indices
        prompt = req.prompt_array()
        replayer._verify(slots, prompt)  # the cache's own slots pass
        with pytest.raises(AssertionError, match="whole aligned pages"):
            replayer._verify(slots + 1, prompt)
    finally:
        replayer.finish()


def test_sweep_gives_l1_at_least_the_longest_prompt():
    """An engine cannot compute a prompt longer than its KV pool: the sweep's tiered L1 never is."""
    from tierkv.replay.report import sweep_config

    config = ReplayConfig(l1_tokens=500_000, l2_tokens=4_000_000, page_size=16)
    assert sweep_config(config, 1_000_000).l1_tokens == 111_104  # a ninth
    tiered = sweep_config(config, 1_000_000, min_l1_tokens=126_195)
    assert tiered.l1_tokens == 126_208 and tiered.l1_tokens + tiered.l2_tokens <= 1_000_000
    assert sweep_config(config, 10_000_000, min_l1_tokens=126_195).l1_tokens == 1_111_104


def test_per_request_hits_are_kept_as_columns_with_running_totals(requests):
    from tierkv.replay.replay import RequestHits, RequestHitsLog

    hits = [RequestHits(100, 16, 32, 0), RequestHits(50, cached=False), RequestHits(70, 0, 0, 64)]
    log = RequestHitsLog(hits)
    assert list(log) == hits and log == hits and log[-1] == hits[-1] and log[1:] == hits[1:]
    assert log.totals == {"prompt_tokens": 220, "l1": 16, "l2": 32, "l3": 64, "cached": 2}
    result = replay(requests[:40], ReplayConfig(l1_tokens=4096, l2_tokens=16384))
    assert result.tier_hits() == {t: sum(getattr(r, t) for r in result.requests) for t in ("l1", "l2", "l3")}
    assert result.prompt_tokens == sum(r.input_length for r in requests[:40])
