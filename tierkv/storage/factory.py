"""Open a page store from a name or URL plus backend keys from the extra-config JSON.

Specs: ``memory``; ``file`` / ``file:///abs/dir`` / ``file:rel/dir``; ``redis`` /
``redis://[user][:password]@host:port/db`` (``valkey://`` is an alias);
``redis+cluster://[user][:password]@host:port`` (any node of a Redis Cluster); ``mooncake`` /
``mooncake://master_host:port``. Values named in the URL are defaults; the same key in
``extra_config`` overrides them. A ``"faults"`` object in ``extra_config`` wraps any backend in
:class:`tierkv.storage.faults.FaultyStore`. A ``"page_key"`` (or the file ``$TIERKV_PAGE_KEY_FILE``
names) makes every page carry a MAC; ``"max_bytes"`` bounds the file and memory backends (LRU) and
``"ttl_s"`` gives Redis pages an expiry.
"""

from __future__ import annotations

import importlib
import os
from urllib.parse import unquote, urlsplit

from tierkv.storage.base import PageStore
from tierkv.storage.page_format import check_page_key
from tierkv.validate import check_int, check_seconds

# A file holding the page key (the shared secret that authenticates L3 pages), when the extra config
# names none: keeps the secret out of command lines and config files.
PAGE_KEY_FILE_ENV = "TIERKV_PAGE_KEY_FILE"

# Backend keys allowed in extra_config, with their types (float also accepts int).
BACKEND_OPTIONS: dict[str, dict[str, type]] = {
    "memory": {"max_bytes": int},
    "file": {"dir": str, "fsync": bool, "max_bytes": int, "retry_backoff_s": float},
    "redis": {"host": str, "port": int, "db": int, "username": str, "password": str, "key_prefix": str,
              "timeout_s": float, "batch_pages": int, "retry_backoff_s": float, "ttl_s": float},
    "redis_cluster": {"host": str, "port": int, "db": int, "username": str, "password": str, "key_prefix": str,
                      "timeout_s": float, "batch_pages": int, "retry_backoff_s": float, "ttl_s": float},
    "mooncake": {"master": str, "metadata_server": str, "local_hostname": str, "protocol": str,
                 "device_name": str, "global_segment_size": int, "local_buffer_size": int,
                 "key_prefix": str, "replica_num": int, "retry_backoff_s": float},
}
# Every backend may be wrapped in fault injection (tests, chaos runs): see tierkv.storage.faults; and
# every backend may authenticate its pages with a shared secret: see tierkv.storage.page_format.
for _options in BACKEND_OPTIONS.values():
    _options["faults"] = dict
    _options["page_key"] = str
SECRET_OPTIONS = ("password", "page_key")
_ALIASES = {"valkey": "redis", "redis+cluster": "redis_cluster", "valkey+cluster": "redis_cluster"}
# Ranges of the numeric options (every backend's option of that name): waits must be finite and > 0.
_SECONDS_OPTIONS = {"timeout_s", "retry_backoff_s", "ttl_s"}
_INT_RANGES = {"port": (1, 65535), "db": (0, None), "batch_pages": (1, None), "global_segment_size": (1, None),
               "local_buffer_size": (1, None), "replica_num": (1, None), "max_bytes": (1, None)}


def parse_spec(spec: str) -> tuple[str, dict]:
    """The backend name and the options a spec's URL carries; ValueError for an unknown backend."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"storage backend spec must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        backend, options = _ALIASES.get(spec, spec), {}
    else:
        url = urlsplit(spec)
        backend = _ALIASES.get(url.scheme, url.scheme)
        options = _url_options(backend, spec, url)
    if backend not in BACKEND_OPTIONS:
        raise ValueError(f"storage backend {redact_spec(spec)!r} is not one of {sorted(BACKEND_OPTIONS)} "
                         f"(by name or as a URL)")
    return backend, options


def _url_options(backend: str, spec: str, url) -> dict:
    if backend == "file":
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {redact_spec(spec)!r} names host {url.hostname!r}; "
                             "use file:///abs/dir or file:dir")
        if not url.path:
            raise ValueError(f"file URL {redact_spec(spec)!r} names no directory")
        return {"dir": unquote(url.path)}
    if backend in ("redis", "redis_cluster"):
        options: dict = {}
        if url.hostname:
            options["host"] = url.hostname
        if url.port is not None:
            options["port"] = url.port
        if url.username:
            options["username"] = unquote(url.username)
        if url.password is not None:
            options["password"] = unquote(url.password)
        db = url.path.strip("/")
        if db:
            if not db.isdigit():
                raise ValueError(f"redis URL {redact_spec(spec)!r}: db {db!r} is not a number")
            options["db"] = int(db)
        return options
    if backend == "mooncake":
        if not url.hostname or url.port is None:
            raise ValueError(f"mooncake URL {redact_spec(spec)!r} must be mooncake://master_host:port")
        return {"master": f"{url.hostname}:{url.port}"}
    return {}


def redact_spec(spec: str) -> str:
    """``spec`` with a URL password replaced by ``***``: the only form of a spec messages may show."""
    try:
        password = urlsplit(spec).password
    except ValueError:
        password = None
    return spec.replace(password, "***") if password else spec


def check_options(backend: str, options: dict) -> dict:
    """``options`` if every key is known to ``backend`` with its type; ValueError naming the first bad one."""
    allowed = BACKEND_OPTIONS[backend]
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(f"unknown {backend} storage option {key!r} (known: {sorted(allowed)})")
        kind = allowed[key]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
              else isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))
        if not ok:
            shown = "***" if key in SECRET_OPTIONS else repr(value)
            raise ValueError(f"{backend} storage option {key!r} must be {kind.__name__}, got {shown} "
                             f"({type(value).__name__})")
        if key in _SECONDS_OPTIONS:
            check_seconds(f"{backend} storage option {key!r}", value, positive=True)
        elif key in _INT_RANGES:
            check_int(f"{backend} storage option {key!r}", value, *_INT_RANGES[key])
    return options


def resolve_page_key(options: dict) -> bytes | None:
    """Pop ``page_key`` from ``options``; without one, read the file ``$TIERKV_PAGE_KEY_FILE`` names.

    Errors name the option or the file, never the key.
    """
    page_key = options.pop("page_key", None)
    path = os.environ.get(PAGE_KEY_FILE_ENV)
    if page_key is None and path:
        try:
            with open(path, "rb") as key_file:
                page_key = key_file.read().strip()
        except OSError as err:
            raise ValueError(f"{PAGE_KEY_FILE_ENV}={path!r}: cannot read the page key: {err.strerror}") from None
    return check_page_key(page_key)


def open_store(spec: str, namespace: str, page_nbytes: int, extra_config: dict | None = None) -> PageStore:
    """A page store for ``spec`` (name or URL) configured by the URL and ``extra_config``'s backend keys."""
    backend, options = parse_spec(spec)
    if extra_config is not None and not isinstance(extra_config, dict):
        raise ValueError(f"extra_config must be a dict, got {type(extra_config).__name__}")
    options = check_options(backend, {**options, **(extra_config or {})})
    page_key = resolve_page_key(options)
    faults = options.pop("faults", None)
    if faults is not None:
        from tierkv.storage.faults import wrap_with_faults
        return wrap_with_faults(lambda inner_nbytes: _open_backend(backend, namespace, inner_nbytes, options),
                                namespace, page_nbytes, faults, page_key)
    return _open_backend(backend, namespace, page_nbytes, options, page_key)


def _open_backend(backend: str, namespace: str, page_nbytes: int, options: dict,
                  page_key: bytes | None = None) -> PageStore:
    if backend == "memory":
        from tierkv.storage.memory import MemoryStore
        return MemoryStore(namespace, page_nbytes, max_bytes=options.get("max_bytes"), page_key=page_key)
    if backend == "file":
        from tierkv.storage.file import FileStore
        if "dir" not in options:
            raise ValueError("file storage needs a directory: file:///abs/dir, file:dir or extra_config "
                             "'dir'")
        return FileStore(namespace, page_nbytes, root=options["dir"], fsync=options.get("fsync", False),
                         max_bytes=options.get("max_bytes"), retry_backoff_s=options.get("retry_backoff_s", 1.0),
                         page_key=page_key)
    if backend == "redis":
        return _redis_store_class("redis_store", "RedisStore")(namespace, page_nbytes, **options, page_key=page_key)
    if backend == "redis_cluster":
        return _redis_store_class("redis_cluster", "RedisClusterStore")(namespace, page_nbytes, **options,
                                                                         page_key=page_key)
    if "master" not in options:
        raise ValueError("mooncake storage needs a master: mooncake://host:port or extra_config 'master'")
    from tierkv.storage.mooncake_store import MooncakeStore
    return MooncakeStore(namespace, page_nbytes, **options, page_key=page_key)


def _redis_store_class(module: str, name: str) -> type:
    """A redis-py backed store class; a clear error when redis-py (an optional extra) is missing."""
    try:
        store_module = importlib.import_module(f"tierkv.storage.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != "redis":
            raise
        raise ValueError("the redis backends need redis-py: pip install 'tierkv-hicache[redis]'") from None
    return getattr(store_module, name)
