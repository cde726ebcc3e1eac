"""Names of the tierkv-hicache distribution that cannot be confused with the index's unrelated ``tierkv``.

Both projects install an import package called ``tierkv`` (and a ``tierkv`` command); whichever was
installed last owns it. ``tierkv_hicache`` exists only in this distribution, so ``tierkv-hicache`` (the
command), ``python -m tierkv_hicache`` and the vLLM module path ``tierkv_hicache.vllm`` first check that
the ``tierkv`` they import is this project and otherwise stop with an error saying how to fix it.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "tierkv-hicache"
# A module only this project's tierkv has (the other one ships tierkv/connectors/, tierkv/cache.py, ...).
_OWN_MODULE = "tierkv.integrations.vllm_config"


def check_tierkv() -> None:
    """ImportError naming the imported ``tierkv``'s location when it is not this project's package."""
    spec = importlib.util.find_spec("tierkv")
    if spec is None:
        raise ImportError(f"no tierkv package is importable: pip install {DISTRIBUTION}")
    try:
        own = importlib.util.find_spec(_OWN_MODULE) is not None
    except ImportError:
        own = False
    if not own:
        where = spec.origin or list(spec.submodule_search_locations or [])
        raise ImportError(
            f"the tierkv package at {where} is not {DISTRIBUTION} (it has no {_OWN_MODULE}): the package "
            f"index's unrelated 'tierkv' distribution is installed over it. Fix: pip uninstall -y tierkv "
            f"&& pip install {DISTRIBUTION} (or pip install -e <checkout>)")


def main(argv: list[str] | None = None) -> int:
    """The ``tierkv-hicache`` command: tierkv's CLI after checking which tierkv is installed."""
    check_tierkv()
    from tierkv.cli import main as tierkv_main
    return tierkv_main(argv)
