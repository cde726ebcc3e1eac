"""Real vLLM (CPU) side by side: vanilla vLLM, vLLM with a connector that does nothing, vLLM's native CPU
offloading, and tierkv (L2; L2 + file L3; L2 + a file L3 a previous engine filled).

The workload is the multi-turn conversation trace scaled to the tiny model: each 512-token trace block
becomes ``--block-tokens`` seeded tokens, requests run one at a time in trace order, and vLLM's own
prefix cache (L1) is cut to ``--l1-blocks`` blocks so turns of a conversation outlive it only in the
lower tiers. Per mode: prefill tokens computed (prompt tokens vLLM did not get from any cache) and
TTFT (wall time of a one-token generate), p50 as min / median over the repeats and p99 of the median
repeat, with ratios against vanilla vLLM ("none") and against the no-op connector ("noop": merely
configuring a KV connector changes vLLM's step, see bench/noop_connector.py). For tierkv modes, the
connector's own time per engine step, scheduler + worker methods (from its counters; the worker's is
summed over ranks and reported in 10 ms lots, so up to 10 ms of it may be missing).

Run with the vLLM venv's python (scripts/setup_vllm.sh prints it):
    .venv-vllm/bin/python bench/bench_vllm.py --requests 80 --repeats 3
Each mode starts its own engine in a subprocess; modes are interleaved within every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32
# "offload" is vLLM's OffloadingConnector (0.32.0 refuses to start on CPU-only hosts: it reports that);
# "simple-offload" is vLLM's SimpleCPUOffloadConnector, its other native CPU offloading connector;
# "tierkv+warm" first runs the workload in an untimed engine that fills the file L3, then times a fresh one.
MODES = ("none", "noop", "offload", "simple-offload", "tierkv", "tierkv+file", "tierkv+warm")
TRACE = REPO / "tests" / "fixtures" / "conversation_200.jsonl"


def workload(num_requests: int, block_tokens: int, max_prompt: int) -> list[list[int]]:
    """Prompts from the trace: every trace block id maps to its own seeded run of byte tokens."""
    from tierkv.replay.trace import BLOCK_TOKENS
    lines = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    lines.sort(key=lambda r: r["timestamp"])
    prompts = []
    for record in lines[:num_requests]:
        tokens: list[int] = []
        for block_id in record["hash_ids"]:
            rng = random.Random(block_id)
            tokens += [rng.randrange(256) for _ in range(block_tokens)]
        length = max(1, record["input_length"] * block_tokens // BLOCK_TOKENS)
        prompts.append(tokens[:min(length, max_prompt)])
    return prompts


def engine_kwargs(mode: str, l2_bytes: int, l3_dir: str) -> dict:
    from vllm.config import KVTransferConfig
    if mode == "none":
        return {}
    if mode == "noop":
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="bench.noop_connector", kv_role="kv_both")}
    if mode == "offload":
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": l2_bytes})}
    if mode == "simple-offload":
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": l2_bytes})}
    extra: dict = {"hicache_size_gb": l2_bytes / 1e9}
    if mode in ("tierkv+file", "tierkv+warm"):
        extra.update(storage_backend=f"file://{l3_dir}", prefetch_threshold=0)
    return {"kv_transfer_config": KVTransferConfig(
        kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config=extra)}


def run_mode(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from tests.vllm_model import build_tiny_llama

    model = build_tiny_llama(args.model_dir)
    llm = LLM(model=model, dtype="bfloat16", max_model_len=args.max_prompt + 16, block_size=BLOCK_SIZE,
              enforce_eager=True, seed=0, num_gpu_blocks_override=args.l1_blocks,
              **engine_kwargs(args.mode, args.l2_bytes, args.l3_dir))
    sampling = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=[300] * 40)], sampling, use_tqdm=False)  # warm-up
    ttft_s, computed, total = [], 0, 0
    for prompt in workload(args.requests, args.block_tokens, args.max_prompt):
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)[0]
        ttft_s.append(time.perf_counter() - start)
        computed += len(prompt) - out.num_cached_tokens
        total += len(prompt)
    llm.llm_engine.engine_core.shutdown(timeout=60)  # graceful: the connector logs its counters as it stops
    return {"mode": args.mode, "ttft_s": ttft_s, "prefill_computed": computed, "prompt_tokens": total}


_COUNTERS = "tierkv: counters at shutdown: "


def run_subprocess(args: argparse.Namespace, mode: str, l3_dir: str) -> tuple[dict | None, str]:
    """One engine's result (with the connector's counters, if it logged them), or None and why not."""
    cmd = [sys.executable, __file__, "--mode", mode, "--l3-dir", l3_dir] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("mode", "modes", "repeats", "l3_dir")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        errors = [ln for ln in proc.stderr.splitlines() if "Exception:" in ln or "Error:" in ln]
        return None, (errors[0] if errors else proc.stderr[-300:]).split("] ")[-1].strip()
    result = json.loads(lines[-1].removeprefix("RESULT "))
    counters = [ln.split(_COUNTERS, 1)[1] for ln in (proc.stdout + proc.stderr).splitlines() if _COUNTERS in ln]
    if counters:
        result["counters"] = json.loads(counters[-1])
    return result, ""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per 512-token trace block")
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--l1-blocks", type=int, default=48, help="vLLM's own KV blocks (its prefix cache)")
    parser.add_argument("--l2-bytes", type=int, default=64 << 20, help="host bytes for offload / tierkv L2")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tierkv-bench-tiny-llama"))
    parser.add_argument("--l3-dir", default="")
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return
    runs: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="tierkv-bench-l3-") as l3_dir:
                if mode == "tierkv+warm":  # the untimed engine that fills L3 (as before a restart)
                    result, why = run_subprocess(args, mode, l3_dir)
                    if result is None:
                        failures[mode] = why
                        continue
                result, why = run_subprocess(args, mode, l3_dir)
            if result is None:
                failures[mode] = why
            else:
                runs.setdefault(mode, []).append(result)
    print(f"{args.requests} requests, {args.repeats} interleaved repeats; TTFT p50 min / median over repeats")
    report(runs, failures)

def report(runs: dict[str, list[dict]], failures: dict[str, str]) -> None:
    rows = {}
    for mode, results in runs.items():
        p50s = [percentile(r["ttft_s"], 0.5) for r in results]
        median = results[p50s.index(statistics.median_low(p50s))]
        rows[mode] = (median, min(p50s), statistics.median(p50s))
    print(f"{'mode':<14} {'computed':>9} {'of prompt':>10} {'p50 min ms':>11} {'p50 med ms':>11} {'p99 ms':>8} "
          f"{'vs none':>8} {'vs noop':>8} {'connector us/step':>22}")
    for mode, (median, p50_min, p50_median) in rows.items():
        ratios = [f"{p50_median / rows[base][2]:.2f}x" if base in rows else "-" for base in ("none", "noop")]
        counters = median.get("counters")
        per_step = "-"
        if counters and counters.get("steps"):
            steps = counters["steps"]
            per_step = (f"{counters['scheduler_busy_us'] / steps:.0f} + {counters['worker_busy_us'] / steps:.0f}"
                        f" ({steps} steps)")
        print(f"{mode:<14} {median['prefill_computed']:>9} {median['prompt_tokens']:>10} {p50_min * 1e3:>11.1f} "
              f"{p50_median * 1e3:>11.1f} {percentile(median['ttft_s'], 0.99) * 1e3:>8.1f} {ratios[0]:>8} "
              f"{ratios[1]:>8} {per_step:>22}")
    for mode, reason in failures.items():
        print(f"{mode:<14} did not start: {reason}")

if __name__ == "__main__":
    main()
