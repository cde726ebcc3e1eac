"""`bash scripts/demo.sh` from a clone in an ordinary folder: it reads nothing outside the repository."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("scripts/demo.sh", "scripts/setup_env.sh")


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def clone():
    """A git clone of this repository in /tmp, with the working tree's uncommitted changes laid over it."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    dest = Path(tempfile.mkdtemp(prefix="tierkv-clone-", dir="/tmp")) / "tierkv"
    _git("clone", "--quiet", "--no-hardlinks", str(ROOT), str(dest))
    for rel in _git("ls-files", "--modified", "--others", "--exclude-standard", "-z").split("\0"):
        if rel and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    for rel in _git("ls-files", "--deleted", "-z").split("\0"):
        if rel:
            (dest / rel).unlink(missing_ok=True)
    yield dest
    shutil.rmtree(dest.parent, ignore_errors=True)


def test_demo_scripts_name_no_path_outside_the_repository(clone):
    for script in SCRIPTS:
        text = (clone / script).read_text()
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
        outside = re.findall(r"\.\./[\w./-]*", code)
        assert not outside, f"{script} reaches outside the repository: {outside}"
        assert "shared" not in code
        absolute = re.findall(r"(?<![\w$}.:/])/(?:work|home|opt|root|mnt)\b[\w./-]*", code)
        assert not absolute, f"{script} names machine paths: {absolute}"


def test_demo_default_trace_is_in_the_clone(clone):
    default = re.search(r'TRACE="\$\{1:-([^}]+)\}"', (clone / "scripts/demo.sh").read_text()).group(1)
    assert (clone / default).is_file() and default.endswith(".gz")
    assert (clone / Path(default).parent / "README.md").is_file()  # attribution and license beside it


def test_demo_runs_from_the_clone_on_a_slice_of_its_trace(clone, tmp_path):
    """The real script, with the running venv reused and nothing installed, on the first 60 requests."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TIERKV_REQUIRE_NATIVE")}
    env.update(TIERKV_VENV=sys.prefix, TIERKV_SKIP_INSTALL="1", TIERKV_DEMO_JSON=str(tmp_path / "r.json"),
               TIERKV_DEMO_PLOT=str(tmp_path / "r.png"))
    default = re.search(r'TRACE="\$\{1:-([^}]+)\}"', (clone / "scripts/demo.sh").read_text()).group(1)
    proc = subprocess.run(["bash", str(clone / "scripts/demo.sh"), default, "--limit", "60", "--no-baselines",
                           "--serial"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["requests"] == 60 and report["trace"].endswith(".gz")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_demo_writes_each_run_to_its_own_folder_and_says_where(clone, tmp_path):
    """Two runs without TIERKV_DEMO_* never share a report file, and each names its report and plot."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TIERKV_REQUIRE_NATIVE") and not k.startswith("TIERKV_DEMO")}
    env.update(TIERKV_VENV=sys.prefix, TIERKV_SKIP_INSTALL="1", TMPDIR=str(tmp_path))
    reports = []
    for _ in range(2):
        proc = subprocess.run(["bash", str(clone / "scripts/demo.sh"), "data/traces/conversation_trace.jsonl.gz",
                               "--limit", "20", "--no-baselines", "--serial"],
                              cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = Path(re.search(r"\[demo\] report: (\S+)", proc.stderr).group(1))
        plot = Path(re.search(r"\[demo\] plot: +(\S+)", proc.stderr).group(1))
        assert report.is_file() and plot.is_file() and tmp_path in report.parents
        assert json.loads(report.read_text())["requests"] == 20
        reports.append(report)
    assert reports[0].parent != reports[1].parent
