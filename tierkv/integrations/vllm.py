"""tierkv as a vLLM KV connector: vLLM's prefix cache stays L1, tierkv adds L2 (host) and L3 (storage).

Switch it on with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"hicache_size_gb": 4,
                                                        "storage_backend": "file:///mnt/kv"}}'

vLLM builds one instance in its scheduler process (role SCHEDULER) and one per worker (role WORKER).
They share no memory: the scheduler half (:mod:`tierkv.integrations.vllm_plan`) owns the radix tree
over L2 and plans every copy; the worker half (:mod:`tierkv.integrations.vllm_io`) owns the L2 bytes
and the L3 I/O and reports back through vLLM's connector output. This is the only tierkv module that
imports vLLM.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.integrations.vllm_config import (
    ConnectorConfig,
    KVGeometry,
    check_host_memory,
    host_pages,
    model_tag,
    validate,
    weights_digest,
    write_stats,
)
from tierkv.integrations.vllm_io import WorkerTiers
from tierkv.integrations.vllm_plan import SchedulerTiers, StepPlan
from tierkv.storage.factory import open_store, redact_spec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# under vLLM's logger, so these lines show up (formatted, with the process name) in vLLM's own log
log = init_logger("vllm.tierkv")
_LOG_INTERVAL_S = 10.0
# The worker reports its time in the connector with other news, or alone once this much has gathered.
_REPORT_BUSY_US = 10_000


def route_tierkv_logs() -> None:
    """Send the ``tierkv`` loggers (vllm_io, vllm_plan, the stores: vLLM-free modules) through vLLM's own
    handlers, so their warnings carry vLLM's format (level, time, process) and obey VLLM_LOGGING_LEVEL."""
    vllm_logger, tierkv_logger = logging.getLogger("vllm"), logging.getLogger("tierkv")
    if not vllm_logger.handlers:
        return  # VLLM_CONFIGURE_LOGGING=0: the user's own logging config decides for both
    for handler in vllm_logger.handlers:
        if handler not in tierkv_logger.handlers:
            tierkv_logger.addHandler(handler)
    tierkv_logger.setLevel(vllm_logger.level)
    tierkv_logger.propagate = False  # vLLM's logger does not propagate either: no second copy via root


def validate_extra_config(extra: dict | None) -> ConnectorConfig:
    """:func:`tierkv.integrations.vllm_config.validate` with its warnings in vLLM's log format."""
    route_tierkv_logs()
    return validate(extra)


def _timed(method: Callable) -> Callable:
    """Add the method's wall time to the connector's ``busy_s`` (tierkv's own cost in vLLM's step)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start
    return timed


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the step's plan."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: L3 backups written (per backup id, how many ranks) and counter deltas."""

    backups_done: dict[int, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, TierKVWorkerMetadata)
        merged = TierKVWorkerMetadata(dict(self.backups_done), dict(self.counters))
        for key, count in other.backups_done.items():
            merged.backups_done[key] = merged.backups_done.get(key, 0) + count
        for key, delta in other.counters.items():
            merged.counters[key] = merged.counters.get(key, 0) + delta
        return merged


def _geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: ConnectorConfig,
              tp_rank: int) -> KVGeometry:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"TierKVConnector supports models with one KV cache group, got {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not hasattr(spec, "num_kv_heads") or getattr(spec, "sliding_window", None):
        raise ValueError(f"TierKVConnector supports full attention only, got {type(spec).__name__}")
    num_layers = len(groups[0].layer_names)
    block_nbytes = spec.page_size_bytes
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    layout = f"vllm/{kv_cache_config.kv_cache_layout or 'default'}/{type(spec).__name__}"
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    return KVGeometry(
        model_tag=model_tag(config, vllm_config.model_config.model), kv_layout=layout,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_shape=(spec.num_kv_heads, spec.block_size, spec.head_size, head_size_v),
        num_layers=num_layers, block_size=spec.block_size, block_nbytes=block_nbytes,
        num_device_blocks=kv_cache_config.num_blocks,
        host_pages=host_pages(config, block_nbytes * num_layers, kv_cache_config.num_blocks),
        tp_rank=tp_rank, tp_size=tp_size)


def _tp_rank(role: KVConnectorRole) -> int:
    if role != KVConnectorRole.WORKER:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()


def _token_keyed(request: "Request") -> bool:
    """Whether the prompt's token ids (in the request's namespace, see :func:`_extra_key`) name its KV.
    Images and prompt embeddings change the KV of equal tokens; such requests neither hit nor fill tierkv."""
    return not (request.mm_features or getattr(request, "prompt_embeds", None) is not None)


@functools.lru_cache(maxsize=256)
def _adapter_identity(name: str, path: str) -> str:
    """A LoRA adapter's name plus a digest of its weights (sizes and first/last MiB of each weight file, as
    for the model), so a retrained adapter under the same name never meets the old one's pages."""
    return f"{name}@{weights_digest(path) if path else 'no-path'}"


def _extra_key(request: "Request") -> str | None:
    """The request's page namespace beyond the model: its cache salt (vLLM's tenant isolation) and its LoRA
    adapter. None for neither, so such requests share pages exactly as vLLM's own prefix cache does."""
    salt = request.cache_salt or None  # vLLM ignores an empty salt too
    lora = request.lora_request
    adapter = _adapter_identity(lora.lora_name, lora.lora_path or "") if lora is not None else None
    if salt is None and adapter is None:
        return None
    return f"salt={salt!r}|lora={adapter!r}"  # repr: no salt text can imitate the adapter field


class _TierKVConnector(KVConnectorBase_V1):
    """A KVConnectorBase_V1 that puts tierkv's L2 and L3 under vLLM's prefix cache."""

    _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM asks this while building its config (GPU, full CUDA graphs): the earliest look at the extra
        config, so a bad one fails before any process loads the model. tierkv needs no piecewise mode."""
        validate_extra_config(extra_config)
        return False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        route_tierkv_logs()
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.busy_s = 0.0
        self._reported_busy_s = 0.0
        tp_rank = _tp_rank(role)
        self.geometry = _geometry(vllm_config, kv_cache_config, self.config, tp_rank)
        if role == KVConnectorRole.WORKER:  # before the L2 is zero-filled (and, on CPU, vLLM's KV allocated)
            from vllm.platforms import current_platform
            g = self.geometry
            check_host_memory(self.config, g.host_pages * g.page_nbytes, g.num_device_blocks * g.page_nbytes,
                              kv_on_host=current_platform.is_cpu())
        store = None
        if self.config.storage_backend:
            store = open_store(self.config.storage_backend, self.geometry.store_namespace(tp_rank),
                               self.geometry.page_nbytes, dict(self.config.storage.backend_config))
        self.layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.scheduler: SchedulerTiers | None = None
        self.worker: WorkerTiers | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # a cache miss, a corrupt page or a dead L3 must cost recomputation, never the request;
                # vLLM's scheduler reads this policy right after building its connector
                log.warning("tierkv: setting kv_load_failure_policy=recompute (was %r)",
                            self._kv_transfer_config.kv_load_failure_policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.scheduler = SchedulerTiers(self.config, self.geometry, store)
            self._hit_sources: dict[str, dict[CacheHitSource, int]] = {}
            self._backup_ranks: dict[int, int] = {}
            self._requests: dict[str, Request] = {}
            self._last_log_s = time.monotonic()
        else:
            self.worker = WorkerTiers(self.config, self.geometry, store)
        l3 = redact_spec(self.config.storage_backend) if self.config.storage_backend else "off"
        log.info("tierkv connector (%s, rank %d): L2 %d pages of %d tokens (%.1f MB), L3 %s, namespace %s",
                 role.name.lower(), tp_rank, self.geometry.host_pages, self.geometry.block_size,
                 self.geometry.host_pages * self.geometry.page_nbytes / 1e6, l3,
                 self.geometry.hash_namespace().name())

    # ==== worker side ==================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register([kv_caches[name] for name in self.layer_names])

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        return meta.plan

    @_timed
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_step(self._plan())

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.worker.load_layer(index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Saves run once per step in :meth:`wait_for_save`: an L2 page holds every layer of a block."""

    @_timed
    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self.worker.finish_step(self._plan())

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.worker.take_finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> TierKVWorkerMetadata | None:
        report = self.worker.take_report()
        busy_us = int((self.busy_s - self._reported_busy_s) * 1e6)
        if not report.backups_done and not report.counters and busy_us < _REPORT_BUSY_US:
            return None
        if busy_us > 0:
            self._reported_busy_s += busy_us / 1e6
            report.add("worker_busy_us", busy_us)
        return TierKVWorkerMetadata({b: 1 for b in report.backups_done}, report.counters)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self._write_stats(final=True)
            self.scheduler.close()

    # ==== scheduler side ===============================================================================
    @_timed
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _token_keyed(request):
            return 0, False
        return self.scheduler.num_new_matched_tokens(request.request_id, list(request.prompt_token_ids or ()),
                                                     num_computed_tokens, _extra_key(request))

    @_timed
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if not _token_keyed(request):
            return
        before = (self.scheduler.stats.l2_hit_tokens, self.scheduler.stats.l3_hit_tokens)
        self.scheduler.after_alloc(request.request_id, list(request.prompt_token_ids or ()),
                                   blocks.get_block_ids()[0], num_external_tokens, _extra_key(request))
        l2 = self.scheduler.stats.l2_hit_tokens - before[0]
        l3 = self.scheduler.stats.l3_hit_tokens - before[1]
        self._hit_sources[request.request_id] = {s: n for s, n in ((CacheHitSource.HOST, l2),
                                                                   (CacheHitSource.DISK, l3)) if n}

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        return self._hit_sources.pop(request.request_id, {}) if num_external_tokens else {}

    @_timed
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TierKVMetadata:
        self.scheduler.stats.steps += 1
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_save(new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_save(req_id, cached.num_computed_tokens[i], scheduler_output)
        return TierKVMetadata(self.scheduler.take_plan())

    def _plan_save(self, req_id: str, num_computed: int, scheduler_output: "SchedulerOutput") -> None:
        request = self._requests.get(req_id)
        if request is None or not _token_keyed(request):
            return
        computed = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        # a decode step rarely completes a block: skip the token list copy (the whole sequence, every
        # running request, every step) unless there is something to save
        if not self.scheduler.wants_save(req_id, min(computed, request.num_tokens)):
            return
        block_ids = self._kv_cache_manager.get_blocks(req_id).get_block_ids()[0]
        self.scheduler.plan_save(req_id, list(request.all_token_ids), block_ids, computed)

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request

    @_timed
    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        done, counters = [], {}
        if isinstance(meta, TierKVWorkerMetadata):
            counters = meta.counters
            for backup_id, ranks in meta.backups_done.items():
                seen = self._backup_ranks.get(backup_id, 0) + ranks
                if seen >= self.geometry.tp_size:  # every rank's pages are written: the L2 copy may go
                    self._backup_ranks.pop(backup_id, None)
                    done.append(backup_id)
                else:
                    self._backup_ranks[backup_id] = seen
        finished = set(connector_output.finished_recving or ())
        if done or counters or finished:
            self.scheduler.on_worker_report(finished, done, counters)
            self._write_stats()

    @_timed
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves ran as the blocks were computed, so vLLM may free them now."""
        self.scheduler.request_finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._hit_sources.pop(request.request_id, None)
        self._write_stats()
        return False, None

    def _write_stats(self, final: bool = False) -> None:
        self.scheduler.stats.scheduler_busy_us = int(self.busy_s * 1e6)
        if self.config.stats_path:  # with the state tests check for leaks
            stats = asdict(self.scheduler.stats)
            stats.update(self.scheduler.state_summary())
            write_stats(self.config.stats_path, stats)
        now = time.monotonic()
        if final:  # one parseable line with every counter (bench/bench_vllm.py reads it)
            log.info("tierkv: counters at shutdown: %s", json.dumps(asdict(self.scheduler.stats)))
        elif now - self._last_log_s >= _LOG_INTERVAL_S:
            self._last_log_s = now
            stats = self.scheduler.stats
            busy_us = stats.scheduler_busy_us + stats.worker_busy_us
            log.info("tierkv: L2 hit %d, L3 hit %d, loaded L2 %d / L3 %d, failed %d, saved %d, backed up %d "
                     "tokens; %.0f us per step in the connector", stats.l2_hit_tokens, stats.l3_hit_tokens,
                     stats.loaded_l2_tokens, stats.loaded_l3_tokens, stats.failed_load_tokens, stats.saved_tokens,
                     stats.backed_up_tokens, busy_us / max(1, stats.steps))


def __getattr__(name: str) -> Any:
    """vLLM finds the connector class by ``getattr(module, "TierKVConnector")`` while it builds its config
    in the front-end process, long before any process loads the model; the extra config is a local of that
    caller (``KVConnectorFactory.get_connector_class(kv_transfer_config)``). Checking it there turns a bad
    key into an error in seconds instead of after the model loaded (vLLM offers no hook with the config
    before then on CPU; on GPU, :meth:`requires_piecewise_for_cudagraph` is one). Without that caller,
    (a plain import, or deserialisation) the class is returned unchecked; the connector checks again when built.
    """
    if name != "TierKVConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    caller = sys._getframe(1)
    for _ in range(3):  # vLLM's caller, possibly through tierkv_hicache.vllm's own __getattr__
        if caller is None:
            break
        transfer_config = caller.f_locals.get("kv_transfer_config")
        if caller.f_code.co_name == "get_connector_class" and hasattr(transfer_config, "kv_connector_extra_config"):
            validate_extra_config(transfer_config.kv_connector_extra_config)
            break
        caller = caller.f_back
    return _TierKVConnector


_TierKVConnector.__name__ = _TierKVConnector.__qualname__ = "TierKVConnector"
