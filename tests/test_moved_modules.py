"""The module paths that moved (tierkv.hicache -> tierkv.cache.hicache, ...) keep working for one release:
each imports with one DeprecationWarning pointing at the importing line and holds its new home's names;
``import tierkv`` and every current module import with no warning."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter: what an importer of each old path sees, one path at a time.
OLD_PATH_PROBE = r"""
import importlib, json, sys, warnings
old, new, statement = sys.argv[1:4]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(compile(statement, "importer.py", "exec"), {})
    shim = sys.modules.get(old) or importlib.import_module(old.rsplit(".", 1)[0])
target = importlib.import_module(new)
names = [k for k in vars(target) if not k.startswith("_")]
same = all(getattr(shim, k) is getattr(target, k) for k in names)
print(json.dumps({"warnings": [[w.category.__name__, w.filename, w.lineno, str(w.message)] for w in caught],
                  "names": len(names), "same": same}))
"""


def probe(old: str, new: str, statement: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", OLD_PATH_PROBE, old, new, statement], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_warns_once_at_the_importer_and_re_exports_its_names(old):
    new = MOVED[old]
    if old == "tierkv._rowcopy":
        pytest.importorskip("tierkv.copy._rowcopy", reason="tierkv.copy._rowcopy is not built")
    result = probe(old, new, f"import {old}")
    assert result["warnings"] == [["DeprecationWarning", "importer.py", 1,
                                   f"{old} is deprecated and will be removed in the next release: "
                                   f"import {new} instead"]]
    assert result["names"] > 0 and result["same"]


def test_the_old_l3_module_names_come_from_the_controller_with_one_warning():
    result = probe("tierkv.cache.l3", "tierkv.cache.l3.controller",
                   "from tierkv.cache.l3 import open_storage, StorageController, StorageStats")
    assert [w[:3] for w in result["warnings"]] == [["DeprecationWarning", "importer.py", 1]]
    assert "import tierkv.cache.l3.controller instead" in result["warnings"][0][3]
    assert result["same"]


def test_an_old_path_names_what_it_lacks():
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c",
                           "from tierkv.cache.l3 import no_such_name"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "cannot import name 'no_such_name'" in proc.stderr


def test_tierkv_and_every_current_module_import_without_a_warning():
    code = ("import pkgutil, importlib, tierkv\n"
            "for m in pkgutil.walk_packages(tierkv.__path__, 'tierkv.'):\n"
            "    if m.name.endswith('__main__'): continue\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except ImportError as exc:\n"
            "        if 'tierkv' in str(exc): raise\n")  # an optional dependency (vLLM) absent: fine
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
