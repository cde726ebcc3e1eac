"""Installing and importing by a name that cannot be confused with the index's unrelated `tierkv`."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_distribution_name_and_self_references_are_not_the_other_tierkv():
    project = _pyproject()["project"]
    assert project["name"] == "tierkv-hicache"
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values()
                                                    for r in extra]
    # an extra naming plain "tierkv[...]" would make pip fetch the other project from the index
    assert not [r for r in requirements if r.split("[")[0].strip() == "tierkv"], requirements
    assert "tierkv-hicache[serve,redis,hf]" in project["optional-dependencies"]["test"]
    assert project["scripts"]["tierkv-hicache"] == "tierkv_hicache:main"


def _run(code: str, path: list[Path], isolated: bool = False) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing from ``path`` first; ``isolated``: from ``path`` only (-S: no
    site-packages, whose editable-install finders would map tierkv's submodules to a checkout)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    flags = ["-S"] if isolated else []
    return subprocess.run([sys.executable, *flags, "-c", code], cwd="/", env=env, capture_output=True, text=True,
                          timeout=120)


def _other_tierkv(root: Path) -> Path:
    """A package laid out as the index's tierkv 0.1.0 (cli, cache, connectors; no integrations)."""
    package = root / "tierkv"
    (package / "connectors" / "vllm").mkdir(parents=True)
    for name in ("__init__.py", "cli.py", "cache.py", "config.py", "connectors/__init__.py",
                 "connectors/vllm/__init__.py"):
        (package / name).write_text("def main():\n    print('the other tierkv')\n")
    return root


def test_the_wrong_tierkv_is_named_with_the_fix(tmp_path):
    other = _other_tierkv(tmp_path)
    proc = _run("import tierkv_hicache.vllm", [other, REPO], isolated=True)
    assert proc.returncode != 0
    message = proc.stderr.strip().splitlines()[-1]
    assert "is not tierkv-hicache" in message and str(other / "tierkv") in message
    assert "pip uninstall -y tierkv && pip install tierkv-hicache" in message
    proc = _run("import sys, tierkv_hicache; sys.exit(tierkv_hicache.main(['--help']))", [other, REPO],
                isolated=True)
    assert proc.returncode != 0 and "is not tierkv-hicache" in proc.stderr
    assert "the other tierkv" not in proc.stdout


def test_our_tierkv_passes_the_check_and_exports_the_connector_path():
    proc = _run("import tierkv_hicache; tierkv_hicache.check_tierkv(); import sys; "
                "sys.exit(tierkv_hicache.main(['replay', '--help']))", [REPO])
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    source = (REPO / "tierkv_hicache" / "vllm.py").read_text()
    assert "import tierkv.integrations.vllm as _connector" in source
