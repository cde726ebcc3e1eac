"""Configuration and KV geometry of the vLLM connector (no vLLM import: the connector fills them in).

``kv_connector_extra_config`` takes tierkv's own keys: the L2 keys of :class:`tierkv.cache.config.CacheConfig`
(``hicache_ratio``, ``hicache_size_gb``, ``write_policy``, ``eviction_policy``, ``load_back_threshold``),
``storage_backend`` (an L3 spec such as ``file:///dir`` or ``redis://host:port/0``) and the L3 keys of
:class:`tierkv.storage.config.StorageConfig` plus the backend's keys, flat in the same object. Two keys
are the connector's own: ``model_tag`` (replaces the model id + weights digest in the namespace) and
``stats_path`` (a JSON file the scheduler half rewrites with its counters).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tierkv.cache.config import CacheConfig
from tierkv.eviction import get_policy
from tierkv.hashing import HashNamespace
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import BACKEND_OPTIONS, parse_spec

# vLLM computes every block once and reuses it through its own prefix cache, so the only policy that
# maps is "back up every block as soon as it is computed".
WRITE_POLICIES = ("write_through",)
_CACHE_KEYS = {"hicache_ratio": (int, float), "hicache_size_gb": (int, float), "write_policy": str,
               "eviction_policy": str, "load_back_threshold": int, "storage_backend": str,
               "model_tag": str, "stats_path": str}


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings; errors are ValueErrors naming the key and the value."""

    hicache_ratio: float = 2.0
    hicache_size_gb: float | None = None
    write_policy: str = "write_through"
    eviction_policy: str = CacheConfig.eviction_policy  # the cache's; measured for an L2 behind vLLM's own L1 (README)
    load_back_threshold: int = 0
    storage_backend: str | None = None
    model_tag: str | None = None
    stats_path: str | None = None
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

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Split vLLM's ``kv_connector_extra_config`` into L2 keys and the L3 (storage) keys."""
        extra = dict(extra or {})
        mine = {}
        for key, kinds in _CACHE_KEYS.items():
            if key in extra:
                value = extra.pop(key)
                if isinstance(value, bool) or not isinstance(value, kinds):
                    raise ValueError(f"kv_connector_extra_config key {key!r} has a wrong type: {value!r}")
                mine[key] = value
        spec = mine.get("storage_backend")
        backend_keys = BACKEND_OPTIONS[parse_spec(spec)[0]] if spec else ()
        storage = StorageConfig.from_dict(extra, backend_keys=backend_keys)
        return cls(**mine, storage=storage)


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
