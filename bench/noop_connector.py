"""A KV connector that does nothing: the baseline for what merely configuring a connector costs in vLLM.

vLLM changes its step when any connector is configured (metadata built and sent every step, the
connector's hooks around each layer), and on near-tie logits even its greedy output; comparing tierkv
against this class separates tierkv's own cost and behaviour from the connector interface's.
Use: ``"kv_connector": "NoopConnector", "kv_connector_module_path": "bench.noop_connector"`` with the
repository root on PYTHONPATH (bench/bench_vllm.py and tests/test_vllm_connector.py do).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    """Never matches, loads or saves anything."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
