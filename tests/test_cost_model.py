"""The fetch-or-recompute and backup-or-not decisions on fixed numbers, and the estimates the cost model
fits from reports (durations passed in: no clock is read)."""

import dataclasses

import pytest

from tierkv.cache.l3.cost_model import (BACKUP_PROBE_EVERY, LOOKUP_PROBE_EVERY, PROBE_EVERY, READ_BACK_PRIOR_PAGES,
                                     CostEstimates, CostModel, backup_worth_writing, pages_worth_fetching)
from tierkv.cache.config import CacheConfig

PAGE = 16


def estimates(per_token=1e-3, per_pair=0.0, call=1e-3, page=1e-3, load=0.0, batch=4):
    return CostEstimates(per_token, per_pair, call, page, load, batch)


def test_recompute_grows_with_depth():
    est = estimates(per_token=1.0, per_pair=0.5)
    # positions 0..3: 4 tokens + 0.5 x (0+1+2+3); positions 100..103: 4 tokens + 0.5 x 406
    assert est.recompute_s(0, 4) == pytest.approx(4 + 0.5 * 6)
    assert est.recompute_s(100, 104) == pytest.approx(4 + 0.5 * 406)
    assert est.recompute_s(5, 5) == 0.0


def test_fetch_counts_one_call_per_batch_and_the_exposed_load():
    est = estimates(call=2.0, page=1.0, load=0.25, batch=4)
    assert est.fetch_s(5, page_size=2) == pytest.approx(2 * 2.0 + 5 * 1.0 + 0.25 * 10)
    assert est.fetch_s(5, page_size=2, from_l3=False) == pytest.approx(0.25 * 10)
    assert est.fetch_s(0, page_size=2) == 0.0


def test_unknown_prefill_rate_fetches_everything():
    assert pages_worth_fetching(None, 0, 7, PAGE) == 7
    assert pages_worth_fetching(None, 0, 0, PAGE) == 0


def test_cheap_store_fetches_all_and_slow_store_nothing():
    # recompute: 16 ms a page; fetch: 1 ms a call + 1 ms a page
    assert pages_worth_fetching(estimates(), 0, 10, PAGE) == 10
    slow = estimates(call=0.5, page=0.05)  # 500 ms a call: more than 10 pages take to recompute
    assert pages_worth_fetching(slow, 0, 10, PAGE) == 0


def test_deep_pages_pay_where_shallow_ones_would_not():
    # a page costs 20 ms to fetch; recompute is 1 ms a token plus attention: a page at position 0
    # saves 16 ms + ~0.1 ms, one at position 4096 saves 16 ms + 0.001 x 4096 x 16 = 81.5 ms
    est = estimates(per_token=1e-3, per_pair=1e-6, call=0.0, page=0.02)
    assert pages_worth_fetching(est, 0, 1, PAGE) == 0
    assert pages_worth_fetching(est, 4096, 1, PAGE) == 1


def test_cut_at_a_batch_end_when_the_next_call_does_not_pay():
    # a call (up to 4 pages) costs 50 ms, pages nothing; a page saves 16 ms: a batch of 4 pays, a
    # fifth page alone does not pay its own call, a full second batch does
    est = estimates(per_token=1e-3, per_pair=0.0, call=0.05, page=0.0, batch=4)
    assert pages_worth_fetching(est, 0, 4, PAGE) == 4  # 64 ms saved, 50 ms spent
    assert pages_worth_fetching(est, 0, 5, PAGE) == 4  # page 5 saves 16 ms, its call costs 50
    assert pages_worth_fetching(est, 0, 8, PAGE) == 8  # the second batch pays like the first


def test_l3_may_pay_counts_the_exists_call():
    model = CostModel(prefill_tokens_per_s=100.0, batch_pages=64, l3_call_s=0.0, l3_page_s=0.001)
    assert model.l3_may_pay(0, 2, PAGE)  # 320 ms of prefill against 2 ms
    model.observe_l3_exists(1.0)  # a second per call: exists + one get cost 2 s, more than 2 pages' 320 ms
    assert not model.l3_may_pay(0, 2, PAGE)
    assert model.l3_may_pay(0, 200, PAGE)  # 32 s of prefill against 1 + 4 calls + 0.2 s of pages


def test_skipped_fetches_probe_the_store_now_and_then():
    model = CostModel(prefill_tokens_per_s=1e6, l3_call_s=1.0)
    got = [model.l3_pages_to_fetch(0, 3, PAGE) for _ in range(PROBE_EVERY)]
    assert got[:-1] == [0] * (PROBE_EVERY - 1) and got[-1] == 3
    assert model.skipped_fetches == PROBE_EVERY


def test_fit_recovers_a_linear_prefill_cost():
    model = CostModel()
    assert model.estimates() is None  # nothing reported yet
    per_token, per_pair, overhead = 2e-4, 3e-8, 5e-3
    for i in range(40):
        num_tokens = 16 + 37 * (i % 9)
        pairs = num_tokens * (100 + 211 * (i % 7))
        model.observe_prefill(overhead + per_token * num_tokens + per_pair * pairs, num_tokens, pairs)
    est = model.estimates()
    assert est.prefill_s_per_token == pytest.approx(per_token, rel=1e-3)
    assert est.prefill_s_per_token_pair == pytest.approx(per_pair, rel=1e-3)


def test_fit_without_spread_in_depth_falls_back_to_a_flat_rate():
    model = CostModel()
    for i in range(20):  # every pass at the same depth per token: the pair term cannot be told apart
        num_tokens = 10 + i
        model.observe_prefill(1e-3 * num_tokens, num_tokens, 50.0 * num_tokens)
    est = model.estimates()
    assert est.prefill_s_per_token + 50 * est.prefill_s_per_token_pair == pytest.approx(1e-3, rel=1e-2)
    assert est.prefill_s_per_token >= 0 and est.prefill_s_per_token_pair >= 0


def test_get_time_net_of_the_call_latency():
    model = CostModel()
    model.observe_l3_exists(0.002)
    model.observe_l3_get(0.010, 4)
    assert model.l3_page_s == pytest.approx(0.002)
    assert model.l3_call_s == pytest.approx(0.002)


def test_disabled_model_decides_nothing():
    model = CostModel(prefill_tokens_per_s=1.0, l3_call_s=100.0, enabled=False)
    assert model.estimates() is None
    assert model.l3_pages_to_fetch(0, 5, PAGE) == 5 and model.l3_may_pay(0, 5, PAGE) and model.load_pays(0, 5)


def test_load_pays_unless_exposed_load_is_slower():
    model = CostModel(prefill_tokens_per_s=1000.0)
    model.observe_load(exposed_s=1e-4, num_tokens=100)
    assert model.load_pays(0, 100)
    model = CostModel(prefill_tokens_per_s=1000.0)
    model.observe_load(exposed_s=1.0, num_tokens=100)  # 10 ms a token exposed: recompute is 1 ms
    assert not model.load_pays(0, 100)


@pytest.mark.parametrize("bad", [0, -5.0, "fast", True])
def test_config_rejects_a_bad_prefill_rate(bad):
    with pytest.raises((ValueError, TypeError), match="prefill_tokens_per_s"):
        CacheConfig(prefill_tokens_per_s=bad)


def test_lookups_that_keep_finding_nothing_stop_but_probe_now_and_then():
    # 10 ms of prefill per page against 1 ms per exists call: asking pays while hits come
    model = CostModel(prefill_tokens_per_s=PAGE / 0.01, batch_pages=64, l3_call_s=0.001, l3_page_s=0.0)
    assert model.l3_may_pay(0, 1, PAGE)
    asked = 0
    while model.l3_may_pay(0, 1, PAGE):  # every lookup finds nothing
        model.observe_l3_lookup(1, 0)
        asked += 1
        assert asked < 100, "misses never stopped the lookups"
    assert asked > 1  # a few early misses (L3 still filling) do not stop them at once
    got = [model.l3_may_pay(0, 1, PAGE) for _ in range(LOOKUP_PROBE_EVERY - 1)]
    assert got == [False] * (LOOKUP_PROBE_EVERY - 2) + [True]  # a probe after LOOKUP_PROBE_EVERY - 1 refusals
    assert model.skipped_lookups == LOOKUP_PROBE_EVERY - 1
    for _ in range(20):  # the probes find pages again: lookups resume
        model.observe_l3_lookup(1, 1)
    assert model.l3_may_pay(0, 1, PAGE)
    assert model.l3_may_pay(0, 100, PAGE)  # a prompt whose full hit saves far more is asked anyway


def test_a_lookup_whose_full_hit_does_not_pay_the_call_is_never_made():
    model = CostModel(prefill_tokens_per_s=PAGE / 0.001, batch_pages=64, l3_call_s=0.001, l3_page_s=0.0)
    assert not model.l3_may_pay(0, 1, PAGE)  # 1 ms saved at best, 1 ms to ask
    assert model.skipped_lookups == 0  # not a hit-rate refusal: never probed


# ---- backups: write a page to L3 only when its expected reads save more than writing it costs ----

def test_backup_pays_when_its_reads_save_more_than_the_write_costs():
    # recompute 16 ms a page, fetch 2 ms (1 ms call + 1 ms page): 14 ms saved per page read back
    est = CostEstimates(1e-3, 0.0, 1e-3, 1e-3, 0.0, batch_pages=4, l3_write_s_per_page=5e-3, read_back_fraction=1.0)
    assert est.backup_gain_s(0, 1, PAGE) == pytest.approx(14e-3 - 5e-3)
    assert backup_worth_writing(est, 0, 1, PAGE)
    rarely_read = dataclasses.replace(est, read_back_fraction=0.25)  # 3.5 ms expected against 5 ms
    assert not backup_worth_writing(rarely_read, 0, 1, PAGE)
    costly_write = dataclasses.replace(est, l3_write_s_per_page=20e-3)  # more than a read ever saves
    assert not backup_worth_writing(costly_write, 0, 1, PAGE)


def test_deep_pages_are_worth_backing_up_where_shallow_ones_are_not():
    # attention makes a page at position 4096 cost 16 ms + 65.5 ms to recompute; at 0, 16 ms + ~0.1 ms
    est = CostEstimates(1e-3, 1e-6, 0.0, 0.0, 0.0, l3_write_s_per_page=10e-3, read_back_fraction=0.5)
    assert not backup_worth_writing(est, 0, 1, PAGE)  # half of ~16 ms < 10 ms
    assert backup_worth_writing(est, 4096, 1, PAGE)  # half of ~81.5 ms > 10 ms


def test_a_page_whose_fetch_never_pays_is_never_worth_writing():
    est = CostEstimates(1e-6, 0.0, 1.0, 1.0, 0.0, l3_write_s_per_page=0.0, read_back_fraction=1.0)
    assert est.backup_gain_s(0, 1, PAGE) == 0.0  # the fetch would be refused: nothing gained, nothing lost
    assert not backup_worth_writing(est, 0, 1, PAGE)


def test_unknown_prefill_rate_backs_up_everything():
    assert backup_worth_writing(None, 0, 5, PAGE)
    model = CostModel()  # nothing reported yet
    model.observe_l3_write(1.0, 1)
    assert model.backup_pages(0, 5, PAGE) == 5 and model.skipped_backups == 0


def test_backups_are_written_until_a_write_is_measured_then_refused_with_probes():
    model = CostModel(prefill_tokens_per_s=1e7, batch_pages=4)  # 1.6 us to recompute a page: no write pays
    assert model.backup_pages(0, 10, PAGE) == 10  # the write's cost is not known yet: write, and measure it
    model.observe_l3_write(cpu_s=4e-4, num_pages=4)
    assert model.l3_write_s_per_page == pytest.approx(1e-4)
    got = [model.backup_pages(0, 10, PAGE) for _ in range(BACKUP_PROBE_EVERY)]
    # a probe keeps the estimates fresh: one get batch, not the whole backup
    assert got == [0] * (BACKUP_PROBE_EVERY - 1) + [4]
    assert model.skipped_backups == BACKUP_PROBE_EVERY
    assert model.backup_pages(0, 10, PAGE) == 0


def test_read_back_fraction_falls_with_unread_writes_and_recovers_with_reads():
    # a page read back saves ~16 ms - 1 ms; writing it costs 3 ms: pays while >= 1 in 5 pages is read
    model = CostModel(prefill_tokens_per_s=PAGE / 0.016, l3_page_s=1e-3)
    assert model.read_back_fraction == 1.0  # the prior: early writes are trusted
    model.observe_l3_write(cpu_s=3e-3, num_pages=1)
    assert model.backup_pages(0, 1, PAGE) == 1
    written = 1
    while model.backup_pages(0, 1, PAGE):  # nothing is ever read back
        model.observe_l3_write(cpu_s=3e-3, num_pages=1)
        written += 1
        assert written < 1000, "unread writes never stopped the backups"
    assert written > READ_BACK_PRIOR_PAGES  # not at the first unread page: reads lag writes
    assert model.read_back_fraction < 0.2
    for _ in range(10):  # later lookups read the pages back (4 a batch): the model changes its mind
        model.observe_l3_get(call_s=4e-3, num_pages=4)
    assert model.read_back_fraction > 0.2 and model.backup_pages(0, 1, PAGE) == 1


def test_read_back_fraction_counts_recent_writes_most():
    model = CostModel()
    model.observe_l3_write(cpu_s=1e-3, num_pages=2000)  # long ago, never read
    assert model.read_back_fraction < 0.01
    for _ in range(300):  # lately: every page written is read back
        model.observe_l3_write(cpu_s=1e-5, num_pages=1)
        model.observe_l3_get(call_s=1e-3, num_pages=1)
    assert model.read_back_fraction > 0.7


def test_disabled_model_backs_up_everything():
    model = CostModel(prefill_tokens_per_s=1e9, enabled=False)
    model.observe_l3_write(cpu_s=1.0, num_pages=1)
    assert [model.backup_pages(0, 2, PAGE) for _ in range(3)] == [2, 2, 2] and model.skipped_backups == 0


def test_writes_count_against_the_read_back_fraction_only_after_the_faster_tiers_let_them_go():
    """Before: every write counted at once, so on a fresh cache whose L1 + L2 hold 500 pages the fraction
    fell below 0.2 after a few hundred writes that nothing could yet read from L3, and every backup was refused."""
    model = CostModel(prefill_tokens_per_s=PAGE / 0.016, l3_page_s=1e-3)
    model.read_back_lag_pages = 500
    for _ in range(100):  # 500 pages in batches of 5: all still in L1/L2, none readable from L3
        model.observe_l3_write(cpu_s=15e-3, num_pages=5)
    assert model.read_back_fraction == 1.0 and model.backup_pages(0, 1, PAGE) == 1
    model.observe_l3_write(cpu_s=15e-3, num_pages=5)  # the oldest 5 pages left the faster tiers, unread
    assert model.read_back_fraction < 1.0
    for _ in range(200):  # from here on every page written a lag ago is read back: the fraction stays high
        model.observe_l3_write(cpu_s=3e-3, num_pages=1)
        model.observe_l3_get(call_s=2e-3, num_pages=1)
    assert model.read_back_fraction > 0.7 and model.backup_pages(0, 1, PAGE) == 1
    for _ in range(2000):  # pages that are never read back: the fraction falls once they leave L1/L2
        model.observe_l3_write(cpu_s=3e-3, num_pages=1)
    assert model.read_back_fraction < 0.2
