"""scripts/test.sh: its opt-out of the real-vLLM venv skips those tests and says so."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TIERKV_VLLM_PYTHON")}
    env.update(TIERKV_VENV=sys.prefix, TIERKV_SKIP_INSTALL="1", **extra)
    return env


def test_skip_vllm_builds_no_venv_and_reports_the_skip(tmp_path):
    proc = subprocess.run(["bash", "scripts/test.sh", "tests/test_vllm_connector.py", "-rs"], cwd=ROOT,
                          env=_env(TIERKV_SKIP_VLLM="1", TIERKV_SGLANG="0", TIERKV_VLLM_VENV=str(tmp_path / "never-built")),
                          capture_output=True, text=True, timeout=600)
    # 5: pytest collected no test, when the module skips itself at import (no vLLM venv here at all)
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "TIERKV_SKIP_VLLM=1: not building the vLLM venv" in proc.stderr
    assert not (tmp_path / "never-built").exists()
    assert "skipped" in proc.stdout and " passed" not in proc.stdout
    assert "TIERKV_SKIP_VLLM=1" in proc.stdout or "no vLLM venv" in proc.stdout
