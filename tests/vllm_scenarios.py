"""Run one real vLLM engine (CPU) through phases of greedy generation; print the results as JSON.

Usage: ``python tests/vllm_scenarios.py '<scenario json>'`` with the vLLM venv's python. The scenario:
``{"model": dir, "connector": extra_config or "noop" or null, "max_tokens": n, "phases": [phase, ...]}``
("noop": bench/noop_connector.py's connector that does nothing; null: no connector; "module_path" may
name tierkv's connector module as "tierkv_hicache.vllm"); a phase:
``{"prompts": name, "salt": cache_salt, "reset_prefix_cache": bool, "signal": [pid, "SIGSTOP"],
"corrupt_l3": file L3 dir, "flush_backups": bool}`` (all but "prompts" optional).
Prompt sets are seeded, so every process builds the same ones. The last stdout line is
``RESULT {"phases": [{"outputs": [[ids]], "cached": [n], "stats": {...}}]}``.

One engine start costs ~30 s on 2 cores, so a test runs several phases in one process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32


def prompt_set(name: str) -> list[list[int]]:
    """Seeded prompt sets: "A".."D" are 3 unrelated 200-token prompts; "shared" has a 128-token common prefix;
    "many" is 24 prompts of 8 groups sharing 96-token prefixes."""
    rng = random.Random(name)
    if name == "many":
        prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(8)]
        return [prefixes[i % 8] + [rng.randrange(256) for _ in range(104)] for i in range(24)]
    if name == "shared":
        prefix = [rng.randrange(256) for _ in range(128)]
        return [prefix + [rng.randrange(256) for _ in range(100)] for _ in range(3)]
    return [[rng.randrange(256) for _ in range(200)] for _ in range(3)]


def _stats(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _flush_backups(llm, sampling, stats_path: str, timeout_s: float = 30.0) -> None:
    """Step the engine with a one-token request until every L3 backup has been reported written
    (the worker reports through step outputs, so an idle engine would never hear of them)."""
    from vllm.inputs import TokensPrompt
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = _stats(stats_path)
        if stats.get("backups_done", 0) >= stats.get("backups_started", 0):
            return
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sampling, use_tqdm=False)
        time.sleep(0.2)


def _corrupt_every_other_page(root: str) -> None:
    """Flip bytes in the payload of every other page of a file L3 (as a bad disk would)."""
    from pathlib import Path

    from tierkv.storage.file_pack import pack_pages
    pages = sorted((str(path), page) for path in Path(root).rglob("*.pack") for page in pack_pages(str(path)))
    for path, (_, payload_at, payload_nbytes) in pages[::2]:
        with open(path, "r+b") as f:
            middle = payload_at + payload_nbytes // 3
            f.seek(middle)
            data = f.read(16)
            f.seek(middle)
            f.write(bytes(b ^ 0xFF for b in data))


def run(scenario: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    extra = scenario.get("connector")
    if extra == "noop":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="bench.noop_connector", kv_role="kv_both")
        extra = None
    elif extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path=scenario.get("module_path", "tierkv.integrations.vllm"),
            kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=scenario["model"], dtype="bfloat16", max_model_len=2048, block_size=BLOCK_SIZE,
              enforce_eager=True, seed=0, **kwargs)
    sampling = SamplingParams(temperature=0, max_tokens=scenario.get("max_tokens", 8))
    flush_sampling = SamplingParams(temperature=0, max_tokens=1)
    stats_path = (extra or {}).get("stats_path")
    results = []
    for phase in scenario["phases"]:
        if phase.get("signal"):
            pid, name = phase["signal"]
            os.kill(pid, getattr(signal, name))
        if phase.get("corrupt_l3"):
            _corrupt_every_other_page(phase["corrupt_l3"])
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        prompts = prompt_set(phase["prompts"])
        salt = {"cache_salt": phase["salt"]} if phase.get("salt") else {}
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p, **salt) for p in prompts], sampling,
                               use_tqdm=False)
        if phase.get("flush_backups") and stats_path:
            _flush_backups(llm, flush_sampling, stats_path)
        results.append({"outputs": [list(o.outputs[0].token_ids) for o in outputs],
                        "cached": [o.num_cached_tokens for o in outputs], "stats": _stats(stats_path)})
    return {"phases": results}


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
