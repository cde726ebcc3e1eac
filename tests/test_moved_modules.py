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

# In a fresh interpreter, what an importer of each old path sees: the warnings raised by that import
# statement alone (compiled as "importer.py", so the warning's location shows the stacklevel), and whether
# the module got by the old path holds the very objects of the new one.
PROBE = r"""
import importlib, json, sys, warnings
results = {}
for old, new, statement in json.loads(sys.argv[1]):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(statement, "importer.py", "exec"), {})
        except ImportError as exc:
            results[old] = {"error": str(exc)}
            continue
    shim = sys.modules[old] if old in sys.modules and statement.startswith("import ") else \
        importlib.import_module(old)
    target = importlib.import_module(new)
    names = [k for k in vars(target) if not k.startswith("_")]
    results[old] = {"warnings": [[w.category.__name__, w.filename, w.lineno, str(w.message)] for w in caught],
                    "names": len(names), "same": all(getattr(shim, k) is getattr(target, k) for k in names)}
print(json.dumps(results))
"""
L3_NAMES = "from tierkv.cache.l3 import open_storage, StorageController, StorageStats"


@pytest.fixture(scope="module")
def probed() -> dict:
    cases = [[old, new, f"import {old}"] for old, new in sorted(MOVED.items())]
    cases.append(["tierkv.cache.l3", "tierkv.cache.l3.controller", L3_NAMES])
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_warns_once_at_the_importer_and_re_exports_its_names(probed, old):
    new, result = MOVED[old], probed[old]
    if "error" in result:  # only the compiled copy may be missing (no C compiler at install)
        assert old == "tierkv._rowcopy", result["error"]
        pytest.importorskip("tierkv.copy._rowcopy", reason="tierkv.copy._rowcopy is not built")
    assert result["warnings"] == [["DeprecationWarning", "importer.py", 1,
                                   f"{old} is deprecated and will be removed in the next release: "
                                   f"import {new} instead"]]
    assert result["names"] > 0 and result["same"]


def test_the_old_l3_module_names_come_from_the_controller_with_one_warning(probed):
    result = probed["tierkv.cache.l3"]
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
