"""The vLLM connector under a module path only this distribution has: ``"kv_connector_module_path":
"tierkv_hicache.vllm"``. With the index's unrelated ``tierkv`` installed instead of ours, vLLM stops
with :func:`tierkv_hicache.check_tierkv`'s message rather than a bare ModuleNotFoundError."""

from typing import Any

from tierkv_hicache import check_tierkv

check_tierkv()

import tierkv.integrations.vllm as _connector  # noqa: E402  (after the check, by design)


def __getattr__(name: str) -> Any:
    """``TierKVConnector``, looked up through tierkv's module so vLLM's early config check runs for this path too."""
    return getattr(_connector, name)
