"""The engine with the cost model: a slow L3 is skipped (recomputed, outputs unchanged), a fast one is
read; a request waiting on its L3 read does not hold back the requests behind it; a tiny model does not
back up every page to an L3 whose writes cost more CPU than recomputing the page."""

import time

from engine_helpers import assert_same, prompts_with_shared_prefix, reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.request import Request

MAX_NEW = 4
PREFIX, SUFFIX = 64, 8


def l3_engine(model, store_dir, faults=None, prefill_tokens_per_s=None, cost_aware=True):
    extra = {"prefetch_threshold": 8, "prefetch_stop_policy": "wait_complete"}
    if faults is not None:
        extra["faults"] = faults
    costs = {} if cost_aware else {"cost_aware": False}
    if prefill_tokens_per_s is not None:
        costs["prefill_tokens_per_s"] = prefill_tokens_per_s
    return Engine(model, EngineConfig(mode="l1+l2+l3", l1_tokens=256, page_size=4, host_layout="page_first",
                                      l3=f"file:{store_dir}", storage_extra=extra, **costs))


def stored_then_served(model, store_dir, prompts, **kwargs):
    """An engine stores prompts[0] in L3; a fresh one (empty L1/L2) serves prompts[1]."""
    first = l3_engine(model, store_dir, **kwargs)
    first.generate(prompts[:1], MAX_NEW)
    first.close()  # flushes the backups to L3
    second = l3_engine(model, store_dir, **kwargs)
    got = second.generate(prompts[1:2], MAX_NEW)[0]
    second.cache.flush()
    second.check_integrity()
    return second, got


def slow_reads(latency_s):
    return {"latency_rate": 1.0, "latency_s": latency_s, "operations": ["exists", "get"]}


def test_slow_l3_is_skipped_and_outputs_match_no_cache(tmp_path):
    """Every exists/get call takes 0.3 s; recomputing the 64-token prefix at a fixed 100k tokens/s takes
    0.6 ms: the read is cut after the one exists call, the prefix recomputed, the outputs exact."""
    model = tiny_model("tiny-llama")
    prompts = prompts_with_shared_prefix(2, PREFIX, SUFFIX, seed=21)
    want = reference(model, prompts, MAX_NEW)
    engine, got = stored_then_served(model, tmp_path, prompts, faults=slow_reads(0.3),
                                     prefill_tokens_per_s=100_000.0)
    assert_same(got, want[1])
    assert got.storage_hit_tokens == 0
    assert engine.cache.storage.stats.prefetch_started == 1
    assert engine.cache.cost_model.skipped_fetches == 1
    engine.close()


def test_same_slow_l3_is_read_when_recompute_is_slower(tmp_path):
    """The same store, a prefill rate of 10 tokens/s (6.4 s for the prefix): the L3 hit is taken."""
    model = tiny_model("tiny-llama")
    prompts = prompts_with_shared_prefix(2, PREFIX, SUFFIX, seed=21)
    want = reference(model, prompts, MAX_NEW)
    engine, got = stored_then_served(model, tmp_path, prompts, faults=slow_reads(0.05), prefill_tokens_per_s=10.0)
    assert_same(got, want[1])
    assert got.storage_hit_tokens >= PREFIX - 4
    assert engine.cache.cost_model.skipped_fetches == 0
    engine.close()


def test_cost_blind_engine_reads_the_slow_l3(tmp_path):
    model = tiny_model("tiny-llama")
    prompts = prompts_with_shared_prefix(2, PREFIX, SUFFIX, seed=21)
    engine, got = stored_then_served(model, tmp_path, prompts, faults=slow_reads(0.05),
                                     prefill_tokens_per_s=100_000.0, cost_aware=False)
    assert got.storage_hit_tokens >= PREFIX - 4
    engine.close()


def test_known_slow_l3_is_not_even_asked(tmp_path):
    """Once a call's latency is measured, a prompt whose whole extension recomputes faster than one
    exists + get starts no prefetch at all."""
    model = tiny_model("tiny-llama")
    first_pair = prompts_with_shared_prefix(2, PREFIX, SUFFIX, seed=22)
    second_pair = prompts_with_shared_prefix(2, PREFIX, SUFFIX, seed=24)
    want = reference(model, [first_pair[1], second_pair[1]], MAX_NEW)
    writer = l3_engine(model, tmp_path, faults=slow_reads(0.3))
    writer.generate([first_pair[0], second_pair[0]], MAX_NEW)
    writer.close()
    engine = l3_engine(model, tmp_path, faults=slow_reads(0.3), prefill_tokens_per_s=100_000.0)
    got = [engine.generate([p], MAX_NEW)[0] for p in (first_pair[1], second_pair[1])]
    for g, w in zip(got, want):
        assert_same(g, w)
    stats = engine.cache.storage.stats
    assert (stats.prefetch_started, stats.prefetch_not_worth) == (1, 1)
    assert sum(g.storage_hit_tokens for g in got) == 0
    engine.close()


def test_request_behind_a_hanging_prefetch_is_admitted(tmp_path):
    """The store's exists hangs; a later request with nothing to prefetch runs to the end meanwhile."""
    model = tiny_model("tiny-llama")
    hang = {"hang_rate": 1.0, "hang_s": 30.0, "operations": ["exists"]}
    engine = l3_engine(model, tmp_path, faults=hang)
    long_prompt, short_prompt = prompts_with_shared_prefix(1, PREFIX, SUFFIX, seed=23)[0], [1, 2, 3]
    blocked = engine.scheduler.submit(Request(long_prompt, MAX_NEW))
    behind = engine.scheduler.submit(Request(short_prompt, MAX_NEW))
    for _ in range(1000):
        if behind.finished:
            break
        engine.scheduler.step()
    assert behind.finished and behind.error is None and len(behind.output) == MAX_NEW
    assert not blocked.finished and blocked in engine.scheduler.waiting
    engine.close()  # interrupts the hang


def cpu_costly_writes(engine, page_cpu_s: float) -> None:
    """Every page the engine's L3 writes first burns ``page_cpu_s`` of its thread's CPU (a store whose
    writes cost CPU, as file creation and checksums do). Both write paths: a page_first host pool's
    backups write rows in place (``batch_set_rows``); patching ``batch_set`` alone burnt nothing, and the
    refusals this file tests came only from a read-back fraction that fell before any read could come."""
    store = engine.cache.storage.store

    def burning(write):
        def costly(keys, *args, **kwargs):
            until_s = time.thread_time() + page_cpu_s * len(keys)
            while time.thread_time() < until_s:
                pass
            return write(keys, *args, **kwargs)
        return costly
    store.batch_set = burning(store.batch_set)
    store.batch_set_rows = burning(store.batch_set_rows)


def serve_one_by_one(engine, prompts):
    got = []
    for prompt in prompts:
        got.append(engine.generate([prompt], MAX_NEW)[0])
        engine.cache.flush()  # the backup is written and measured before the next one is judged
    return got


def test_tiny_model_with_a_costly_l3_does_not_back_up_every_page(tmp_path):
    """5 ms of CPU per page written against a measured tiny-model recompute of microseconds a token:
    after the first write (and while the cost model has no prefill rate) backups are refused, but
    for a probe now and then; outputs stay exact."""
    model = tiny_model("tiny-llama")
    prompts = [prompts_with_shared_prefix(1, PREFIX, SUFFIX, seed=40 + i)[0] for i in range(6)]
    want = reference(model, prompts, MAX_NEW)
    engine = l3_engine(model, tmp_path)
    cpu_costly_writes(engine, page_cpu_s=0.005)
    for g, w in zip(serve_one_by_one(engine, prompts), want):
        assert_same(g, w)
    stats, written_tokens = engine.cache.storage.stats, sum(len(p) - len(p) % 4 for p in prompts)
    assert stats.backed_up_tokens + stats.backup_present_tokens < written_tokens
    assert stats.backup_not_worth_tokens > 0 and engine.cache.cost_model.skipped_backups > 0
    engine.check_integrity()
    engine.close()


def test_same_costly_l3_backs_up_everything_when_recompute_is_slower(tmp_path):
    """The same store with a fixed prefill rate of 10 tokens/s (0.4 s a page): every backup pays."""
    model = tiny_model("tiny-llama")
    prompts = [prompts_with_shared_prefix(1, PREFIX, SUFFIX, seed=40 + i)[0] for i in range(4)]
    engine = l3_engine(model, tmp_path, prefill_tokens_per_s=10.0)
    cpu_costly_writes(engine, page_cpu_s=0.005)
    serve_one_by_one(engine, prompts)
    assert engine.cache.storage.stats.backup_not_worth_tokens == 0
    assert engine.cache.cost_model.skipped_backups == 0
    engine.close()


def test_backups_go_on_while_l1_and_l2_still_hold_what_they_wrote_and_l3_serves_it_later(tmp_path):
    """Recompute costs 40 ms a page (a fixed 100 tokens/s), a write 5 ms of CPU: a backup pays while about one
    page in eight is read back. Before, every write counted as unread at once: after two prompts, all still in
    L1 and L2 and so not yet readable from L3, the fraction fell to 0.09, every later backup was refused, and
    the prompts that left L2 were recomputed (0 L3 hits below). Now a write counts once L1 and L2 could have
    let it go, and the prompts are read back from L3, exactly."""
    model = tiny_model("tiny-llama")
    prompts = [prompts_with_shared_prefix(1, PREFIX, SUFFIX, seed=60 + i)[0] for i in range(16)]
    want = reference(model, prompts[3:5], MAX_NEW)
    engine = l3_engine(model, tmp_path, prefill_tokens_per_s=100.0)
    cpu_costly_writes(engine, page_cpu_s=0.005)
    stats, costs = engine.cache.storage.stats, engine.cache.cost_model
    page_size = engine.cache.config.page_size
    assert sum(len(p) // page_size for p in prompts[:10]) < costs.read_back_lag_pages
    serve_one_by_one(engine, prompts[:10])  # within what L1 and L2 hold: nothing could be read back yet
    assert stats.backup_not_worth_tokens == 0 and costs.skipped_backups == 0
    assert stats.backed_up_tokens == sum(len(p) - len(p) % page_size for p in prompts[:10])
    serve_one_by_one(engine, prompts[10:])  # pushes prompts 3 and 4 out of L1 and L2
    got = serve_one_by_one(engine, prompts[3:5])
    for g, w in zip(got, want):
        assert_same(g, w)
        assert g.storage_hit_tokens > 0 and g.device_hit_tokens == g.host_hit_tokens == 0
    engine.check_integrity()
    engine.close()
