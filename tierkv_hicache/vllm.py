"""The vLLM connector under a module path only this distribution has: ``"kv_connector_module_path":
"tierkv_hicache.vllm"``. With the index's unrelated ``tierkv`` installed instead of ours, vLLM stops
with :func:`tierkv_hicache.check_tierkv`'s message rather than a bare ModuleNotFoundError."""

from tierkv_hicache import check_tierkv

check_tierkv()

from tierkv.integrations.vllm import TierKVConnector  # noqa: E402  (after the check, by design)

__all__ = ["TierKVConnector"]
