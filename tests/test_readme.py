"""README code that readers copy must run as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_tensor_parallel_snippet_runs_as_written(tmp_path):
    block = next(b for b in python_blocks() if "TPGroup.from_default_group" in b)
    code = block.replace("file:///tmp/tierkv-shared", f"file://{tmp_path}")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
