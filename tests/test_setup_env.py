"""scripts/setup_env.sh: which venv it uses, and what it asks pip for, run against a stand-in venv whose
`python` and `pip` only record their arguments (no network, nothing installed)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
case "$*" in *"import torch"*) exit 1;; esac
cat > /dev/null
"""
FAKE_PIP = """#!/usr/bin/env bash
echo "pip $*" >> "$FAKE_LOG"
"""


def fake_venv(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("pip", FAKE_PIP)):
        (path / "bin" / name).write_text(text)
        (path / "bin" / name).chmod(0o755)
    (path / "bin" / "activate").write_text(f'export PATH="{path}/bin:$PATH"\n')
    return path


def source_setup(tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    log = tmp_path / f"calls-{len(list(tmp_path.glob('calls-*.log')))}.log"  # one log per run
    log.touch()
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TIERKV_VENV", "TIERKV_TORCH_INDEX")}
    proc = subprocess.run(["bash", "-c", 'TIERKV_SETUP_FOR=demo; source scripts/setup_env.sh; echo "VENV=$VENV"'],
                          cwd=ROOT, env=base | {"FAKE_LOG": str(log)} | env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr, log.read_text().splitlines()


def test_an_active_venv_is_reused_and_tierkv_venv_wins(tmp_path):
    active, named = fake_venv(tmp_path / "active"), fake_venv(tmp_path / "named")
    out, _ = source_setup(tmp_path, VIRTUAL_ENV=str(active))
    assert f"VENV={active}" in out and f"using the venv in {active}" in out
    out, _ = source_setup(tmp_path, VIRTUAL_ENV=str(active), TIERKV_VENV=str(named))
    assert f"VENV={named}" in out


def test_torch_comes_from_the_named_index_and_each_step_is_announced(tmp_path):
    venv = fake_venv(tmp_path / "v")
    out, calls = source_setup(tmp_path, TIERKV_VENV=str(venv),
                              TIERKV_TORCH_INDEX="https://download.pytorch.org/whl/cpu")
    torch_calls = [c for c in calls if c.startswith("pip install") and c.endswith(" torch==2.13.0")]
    assert any("--dry-run" in c for c in torch_calls)  # what will be fetched is listed first
    assert "pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in calls
    assert "pip install -e .[plot]" in calls
    assert "torch is missing; installing it from https://download.pytorch.org/whl/cpu" in out


def test_without_an_index_the_cuda_download_is_named_and_skip_install_installs_nothing(tmp_path):
    venv = fake_venv(tmp_path / "v")
    out, calls = source_setup(tmp_path, TIERKV_VENV=str(venv))
    assert "TIERKV_TORCH_INDEX" in out and "CUDA build" in out and "pip install torch==2.13.0" in calls  # pinned
    out, calls = source_setup(tmp_path, TIERKV_VENV=str(venv), TIERKV_SKIP_INSTALL="1")
    assert not [c for c in calls if c.startswith("pip ")]
