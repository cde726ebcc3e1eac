"""Optional extras stay optional: without redis-py the package imports and works when no Redis URL is used."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "conversation_200.jsonl"

_WITHOUT_REDIS = """
import importlib.abc, sys

class NoRedis(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRedis())
"""

_BODY = """
import tierkv, tierkv.cache.hicache, tierkv.storage.factory as factory
from tierkv.cli import main
assert main(["replay", FIXTURE, "--limit", "20", "--l1-tokens", "4k", "--l2-tokens", "8k",
             "--l3", "file:" + L3_DIR, "--no-baselines", "--serial"]) == 0
try:
    factory.open_store("redis://127.0.0.1:1/0", "ns", 4096, {})
except ValueError as exc:
    assert "tierkv-hicache[redis]" in str(exc), exc
    print("REDIS-REFUSED")
assert "redis" not in sys.modules
"""


def test_package_works_without_redis_py(tmp_path):
    code = _WITHOUT_REDIS + f"FIXTURE = {str(FIXTURE)!r}\nL3_DIR = {str(tmp_path / 'l3')!r}\n" + _BODY
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REDIS-REFUSED" in proc.stdout
