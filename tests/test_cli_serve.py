"""`tierkv serve`'s flags: each given flag takes effect or is refused (29.2), SGLang HiCache's names map onto
the same config (29.5), the extra config is never echoed (24.6), a device that cannot run the model is
refused at start (24.7), io_wait_timeout_s 0 is refused (24.8). In-process: the parser and the engine
config it makes, and the engine built from it."""

import json
import random

import pytest

from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.cli import serve_parser
from tierkv.engine.engine import Engine
from tierkv.engine.prefetch import l3_counters
from tierkv.engine.serve_config import CliError, engine_config_from_args
from tierkv.storage.config import StorageConfig

SECRET = "page-key-Zq81xK-0123456789abcdef"


def config(*flags: str):
    return engine_config_from_args(serve_parser().parse_args(["--model", "tiny-llama", *flags]))


def refused(*flags: str) -> str:
    with pytest.raises(CliError) as info:
        config(*flags)
    return str(info.value)


def argparse_refused(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as info:
        serve_parser().parse_args(["--model", "tiny-llama", *flags])
    assert info.value.code == 2
    return capsys.readouterr().err


# ---- 29.2: --l3 without a mode that has L3 -----------------------------------------------------------
def test_l3_without_mode_implies_l1_l2_l3_and_attaches_storage(tmp_path):
    cfg = config("--l3", f"file:{tmp_path}", "--l1-tokens", "256", "--page-size", "16")
    assert cfg.mode == "l1+l2+l3" and cfg.l3 == f"file:{tmp_path}"
    engine = Engine("tiny-llama", cfg)
    try:
        assert engine.cache.storage is not None  # the L3 the banner names is really there
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["none", "l1", "l1+l2"])
def test_l3_with_a_mode_without_l3_is_refused(tmp_path, mode):
    message = refused("--l3", f"file:{tmp_path}", "--mode", mode)
    assert "--l3" in message and f"--mode {mode}" in message


@pytest.mark.parametrize("flags", [["--mode", "l1", "--l2-tokens", "20k"], ["--mode", "l1", "--hicache-ratio", "3"],
                                   ["--mode", "none", "--hicache-write-policy", "write_back"],
                                   ["--mode", "l1", "--enable-hierarchical-cache"],
                                   ["--storage-extra", "{}"], ["--hicache-storage-prefetch-policy", "timeout"],
                                   ["--mode", "l1+l2+l3"]])
def test_a_flag_whose_tier_is_missing_is_refused(flags):
    message = refused(*flags)
    assert flags[-2] in message or flags[-1] in message or "l3" in message


# ---- 29.5: SGLang HiCache's flags by their names ------------------------------------------------------
def test_sglang_hicache_command_line_maps_onto_the_engine_config(tmp_path):
    cfg = config("--enable-hierarchical-cache", "--l1-tokens", "512", "--hicache-ratio", "3",
                 "--hicache-write-policy", "write_back", "--hicache-io-backend", "direct",
                 "--hicache-mem-layout", "page_first_direct", "--hicache-storage-backend", f"file:{tmp_path}",
                 "--hicache-storage-prefetch-policy", "timeout",
                 "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 64}),
                 "--page-size", "32", "--radix-eviction-policy", "lfu", "--max-running-requests", "4",
                 "--chunked-prefill-size", "128")
    assert (cfg.mode, cfg.hicache_ratio, cfg.write_policy, cfg.io_backend, cfg.host_layout) == \
        ("l1+l2+l3", 3.0, "write_back", "direct", "page_first_direct")
    assert (cfg.page_size, cfg.eviction_policy, cfg.max_running_requests, cfg.chunk_tokens) == (32, "lfu", 4, 128)
    assert cfg.storage_extra == {"prefetch_threshold": 64, "prefetch_stop_policy": "timeout"}
    engine = Engine("tiny-llama", cfg)
    try:  # each reached the cache it names
        cache = engine.cache
        assert cache.config.write_policy == "write_back" and cache.config.io_backend == "direct"
        assert cache.host_pool.layout == "page_first_direct"
        assert cache.host_pool.num_slots == 3 * 512 + cache.config.staging_tokens
        assert cache.storage.config.prefetch_stop_policy == "timeout"
        assert cache.storage.config.prefetch_threshold == 64
    finally:
        engine.close()


def test_sglang_file_backend_takes_its_directory_from_sglangs_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    cfg = config("--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--l1-tokens", "256")
    assert cfg.mode == "l1+l2+l3" and cfg.storage_extra["dir"] == str(tmp_path)
    engine = Engine("tiny-llama", cfg)
    try:
        engine.generate([list(range(300))], 2)
        engine.cache.flush()
        assert any(tmp_path.rglob("*")), "the file store wrote nothing under SGLang's directory"
    finally:
        engine.close()


def test_hicache_size_is_gb_of_kv_and_chunked_prefill_minus_one_is_whole_prompts():
    cfg = config("--hicache-size", "0.001", "--l1-tokens", "256", "--chunked-prefill-size", "-1")
    assert cfg.hicache_size_gb == 0.001 and cfg.chunk_tokens == 256
    engine = Engine("tiny-llama", cfg)
    try:
        per_token = engine.model.config.kv_spec().bytes_per_token
        staging = engine.cache.config.staging_tokens
        assert engine.cache.host_pool.num_slots == (10**6 // per_token) // 16 * 16 + staging
    finally:
        engine.close()


@pytest.mark.parametrize("flag, value", [("--hicache-io-backend", "kernel_ascend"),
                                         ("--hicache-mem-layout", "page_head"),
                                         ("--hicache-mem-layout", "page_first_kv_split"),
                                         ("--hicache-storage-backend", "hf3fs"),
                                         ("--hicache-storage-backend", "nixl")])
def test_sglang_values_tierkv_lacks_are_refused_by_name(capsys, flag, value):
    err = argparse_refused(capsys, flag, value)
    assert flag in err and value in err and "not implemented by tierkv" in err


@pytest.mark.parametrize("flags", [["--l2-tokens", "20k", "--hicache-ratio", "3"], ["--hicache-ratio", "1"],
                                   ["--l2-tokens", "20k", "--hicache-size", "1"]])
def test_conflicting_or_bad_l2_sizes_are_refused(flags):
    assert "--" in refused(*flags)


# ---- 24.6: the extra config is never echoed ---------------------------------------------------------
@pytest.mark.parametrize("text", [json.dumps(SECRET), json.dumps([SECRET]), json.dumps(7),
                                  '{"page_key": "' + SECRET + '"', json.dumps({"backend_config": SECRET})])
def test_storage_extra_errors_never_show_its_value(tmp_path, text):
    with pytest.raises(ValueError) as info:
        cfg = config("--l3", f"file:{tmp_path}", "--storage-extra", text)
        Engine("tiny-llama", cfg).close()  # the store parses the rest
    message = str(info.value)
    assert SECRET not in message and ("--storage-extra" in message or "backend_config" in message), message


def test_storage_config_errors_never_show_backend_config():
    with pytest.raises(ValueError) as info:
        StorageConfig(backend_config=SECRET)
    assert SECRET not in str(info.value) and "backend_config" in str(info.value)


def test_storage_extra_from_a_file(tmp_path):
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({"prefetch_threshold": 32}))
    assert config("--l3", f"file:{tmp_path}", "--storage-extra", f"@{path}").storage_extra == {"prefetch_threshold": 32}
    assert "cannot read" in refused("--l3", f"file:{tmp_path}", "--storage-extra", f"@{tmp_path}/none.json")


# ---- 24.7: a device that cannot run the model --------------------------------------------------------
@pytest.mark.parametrize("device", ["meta", "cuda:99", "bogus"])
def test_a_device_that_cannot_run_the_model_is_refused_at_start(device):
    assert f"--device {device}" in refused("--device", device)


# ---- 24.8: io_wait_timeout_s must be > 0 ----------------------------------------------------------------
def test_io_wait_timeout_zero_is_refused():
    with pytest.raises(ValueError, match="io_wait_timeout_s"):
        StorageConfig(io_wait_timeout_s=0)
    with pytest.raises(ValueError, match="io_wait_timeout_s"):
        StorageConfig.from_json('{"io_wait_timeout_s": 0}')
    assert StorageConfig(io_wait_timeout_s=0.01).io_wait_timeout_s == 0.01


# ---- 29.4: L3 hits in serve on a workload built for L3 -------------------------------------------------
def _cycle_prompts(engine, rounds: int) -> list:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(600)] for _ in range(6)]
    results = [engine.generate([p], 2)[0] for _ in range(rounds) for p in prompts]
    engine.check_integrity()
    return results


def test_serve_defaults_hit_l3_on_cycled_prompts_that_overflow_l1_and_l2(tmp_path):
    """Six 600-token prompts cycled: L1 (1k) + L2 (2k) hold under a cycle, so under GDSF (no scan
    resistance: each prompt is used once a cycle, the oldest goes) every repeat must come from L3
    (recomputing costs 0.6 s at the fixed rate, far above a file read). With serve's old stop policy
    (best_effort) a request ran in the step its prefetch started, before the exists call returned: 0 L3
    hits, 0 gets, and backups then judged never read back."""
    engine = Engine("tiny-llama", config("--l3", f"file:{tmp_path}", "--l1-tokens", "1k", "--l2-tokens", "2k",
                                         "--prefill-tokens-per-s", "1000", "--eviction-policy", "gdsf"))
    try:
        hits = [r.storage_hit_tokens for r in _cycle_prompts(engine, 3)]
        assert sum(hits[6:]) >= 12 * 512, hits  # nearly every repeat, not a lucky page
        assert engine.cache.storage.config.prefetch_stop_policy == "timeout"  # HiCache's default
        assert l3_counters(engine.cache)["prefetched_tokens"] == sum(hits)
    finally:
        engine.close()


def test_serve_default_policy_keeps_part_of_a_cycle_in_l1_and_l2_and_reads_the_rest_from_l3(tmp_path):
    """The same cycle under the default policy (adaptive): it learns that prompts evicted after one use come
    back (ghosts) and keeps some in L1 and L2, so repeats hit there, and the others still come from L3.
    Every repeat hits, whichever tier serves it."""
    engine = Engine("tiny-llama", config("--l3", f"file:{tmp_path}", "--l1-tokens", "1k", "--l2-tokens", "2k",
                                         "--prefill-tokens-per-s", "1000"))
    try:
        assert engine.cache.config.eviction_policy == "adaptive"
        results = _cycle_prompts(engine, 3)
        repeats = results[6:]
        assert all(r.device_hit_tokens + r.host_hit_tokens + r.storage_hit_tokens >= 512 for r in repeats)
        assert sum(r.device_hit_tokens + r.host_hit_tokens for r in repeats) > 0
        assert sum(r.storage_hit_tokens for r in repeats) > 0
        assert l3_counters(engine.cache)["prefetched_tokens"] == sum(r.storage_hit_tokens for r in results)
    finally:
        engine.close()


def test_with_a_measured_prefill_rate_the_counters_say_why_l3_was_not_read(tmp_path):
    """A tiny model recomputes about as fast as a file store reads: the cost model may skip L3, and then
    its counters (in the banner and the exit line) must say so."""
    engine = Engine("tiny-llama", config("--l3", f"file:{tmp_path}", "--l1-tokens", "1k", "--l2-tokens", "2k"))
    try:
        hits = [r.storage_hit_tokens for r in _cycle_prompts(engine, 3)]
        counters = l3_counters(engine.cache)
        skipped = counters["not_worth"] + counters["cut_after_exists"] + counters["lookups_skipped"]
        assert sum(hits[6:]) > 0 or skipped > 0, (hits, counters)
    finally:
        engine.close()
