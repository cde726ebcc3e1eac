"""Module paths that moved when the cache became one package (tierkv/cache/) and the copies another
(tierkv/copy/). Each old path stays importable for one release: it imports as a small module holding
the names of its new home, and warns once (a DeprecationWarning pointing at the importing line).

A finder rather than a file at each old path: no old path holds a file, so an edit another branch makes
to an old file follows the move through git's rename detection instead of landing on a shim.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "tierkv.hicache": "tierkv.cache.hicache",
    "tierkv.config": "tierkv.cache.config",
    "tierkv.cache_records": "tierkv.cache.records",
    "tierkv.cache_eviction": "tierkv.cache.eviction",
    "tierkv.chunked_load": "tierkv.cache.chunked_load",
    "tierkv.failed_loads": "tierkv.cache.failed_loads",
    "tierkv.layer_load": "tierkv.cache.layer_load",
    "tierkv.retire": "tierkv.cache.retire",
    "tierkv.cache.cost_model": "tierkv.cache.l3.cost_model",
    "tierkv.cache.l3_prefetch": "tierkv.cache.l3.prefetch",
    "tierkv.cache.l3_backup": "tierkv.cache.l3.backup",
    "tierkv.cache.l3_pacing": "tierkv.cache.l3.pacing",
    "tierkv.transfer": "tierkv.copy.transfer",
    "tierkv.cpu_copy": "tierkv.copy.cpu_copy",
    "tierkv.device_copy": "tierkv.copy.device_copy",
    "tierkv._rowcopy": "tierkv.copy._rowcopy",
}
# tierkv.cache.l3 is a package now (its old contents are tierkv.cache.l3.controller): its __init__ warns
# on the old names itself, through moved_names below.


def moved_names(old_module: str, new_module: str, name: str) -> dict[str, object]:
    """The names of ``new_module`` when it holds ``name``, with the one warning an importer of ``old_module``
    gets (for a package whose old contents moved to a submodule: its ``__getattr__`` keeps them)."""
    module = importlib.import_module(new_module)
    if name.startswith("__") or name not in vars(module):
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    # stacklevel 3: past this function and the package's __getattr__ (importlib's frames are skipped)
    warnings.warn(_message(old_module, new_module), DeprecationWarning, stacklevel=3)
    return {k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))}


def _message(old_module: str, new_module: str) -> str:
    return f"{old_module} is deprecated and will be removed in the next release: import {new_module} instead"


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as a module holding its new home's names (private ones too: code written
    against the old module, merged from elsewhere, keeps running)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        new_name = MOVED[module.__name__]
        # stacklevel 2 is the importer: the warnings module skips importlib's own frames
        warnings.warn(_message(module.__name__, new_name), DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new_name)
        module.__dict__.update({k: v for k, v in vars(target).items() if not (k.startswith("__") and k.endswith("__"))})
        module.__all__ = [k for k in vars(target) if not k.startswith("_")]


def install() -> None:
    """Make the old paths importable. First on ``sys.meta_path``: an old path leads to its new home even
    where a stale file could answer it (an old build's ``tierkv/_rowcopy*.so``, another checkout)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
