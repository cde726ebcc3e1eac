"""Every number finite and in range, every flag a real bool, every error naming the field and the value.

The tables are built from the configs' own field annotations, so a field added later is covered too.
"""

import dataclasses
import json
import math

import pytest

from tierkv.replay.replay import ReplayConfig
from tierkv.cache.config import CacheConfig
from tierkv.engine.config import ModelConfig
from tierkv.engine.engine import EngineConfig
from tierkv.hashing import HashNamespace
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import open_store
from tierkv.validate import MAX_SECONDS, check_bool, check_int, check_number, check_seconds, check_text

NAN, INF = math.nan, math.inf
HUGE_INT = 10 ** 400  # overflows a float
# Bad values per annotation. Every int and float field of these configs has a lower bound >= 0.
BAD_BY_TYPE = {
    "int": [NAN, INF, True, False, 1.5, "3", None, -1],
    "int | None": [NAN, True, 1.5, "3", -1],
    "float": [NAN, INF, -INF, True, "1.0", None, -1.0, HUGE_INT],
    "float | None": [NAN, INF, -INF, True, "1.0", -1.0, HUGE_INT],
    "bool": ["yes", "false", 0, 1, None, 1.0],
    "str": [None, 3, True, b"lru"],
}
# Constructor arguments that make the others valid (ReplayConfig needs a size).
REQUIRED = {ReplayConfig: {"l1_tokens": 1024}}
# A storage spec may hold a password: its value is never shown, only its type.
SECRET_FIELDS = {(EngineConfig, "l3"), (ReplayConfig, "l3")}


def _cases(config_cls):
    for f in dataclasses.fields(config_cls):
        for value in BAD_BY_TYPE.get(f.type, []):
            if f.type == "str" and value is None and f.default is None:
                continue
            yield pytest.param(config_cls, f.name, value, id=f"{config_cls.__name__}.{f.name}={value!r}"[:60])


CASES = [c for cls in (CacheConfig, StorageConfig, EngineConfig, ModelConfig, ReplayConfig) for c in _cases(cls)]


def _assert_names_field_and_value(exc: Exception, config_cls, name: str, value) -> None:
    text = str(exc)
    assert name in text, text
    if (config_cls, name) not in SECRET_FIELDS:
        assert repr(value) in text, text


@pytest.mark.parametrize("config_cls,name,value", CASES)
def test_every_bad_field_value_is_refused_naming_field_and_value(config_cls, name, value):
    with pytest.raises((ValueError, TypeError)) as err:
        config_cls(**{**REQUIRED.get(config_cls, {}), name: value})
    _assert_names_field_and_value(err.value, config_cls, name, value)


def test_the_tables_cover_the_issues_examples():
    ids = {(c.values[0], c.values[1], repr(c.values[2])) for c in CASES}
    for cls, name, value in [(CacheConfig, "bigram", "'yes'"), (CacheConfig, "enable_host", "0"),
                             (CacheConfig, "load_back_threshold", "True"),
                             (StorageConfig, "prefetch_timeout_base", "nan"),
                             (StorageConfig, "io_wait_timeout_s", "inf"),
                             (ModelConfig, "rope_theta", "nan"), (EngineConfig, "hicache_ratio", "inf")]:
        assert (cls, name, value) in ids


@pytest.mark.parametrize("text,field", [
    ('{"prefetch_timeout_base": NaN}', "prefetch_timeout_base"),
    ('{"prefetch_timeout_per_ki_token": Infinity}', "prefetch_timeout_per_ki_token"),
    ('{"io_wait_timeout_s": Infinity}', "io_wait_timeout_s"),
    ('{"io_wait_timeout_s": 1e300}', "io_wait_timeout_s"),
    ('{"io_wait_timeout_s": -Infinity}', "io_wait_timeout_s"),
    ('{"prefetch_threshold": true}', "prefetch_threshold"),
    ('{"prefetch_batch_pages": 2.0}', "prefetch_batch_pages"),
    ('{"backup_batch_pages": 0}', "backup_batch_pages"),
    ('{"hicache_storage_pass_prefix_keys": 1}', "hicache_storage_pass_prefix_keys"),
    ('{"prefetch_stop_policy": ["timeout"]}', "prefetch_stop_policy"),
])
def test_extra_config_json_with_nan_infinity_or_wrong_types_is_refused(text, field):
    with pytest.raises(ValueError, match=field):
        StorageConfig.from_json(text)


BACKEND_BAD_OPTIONS = [
    ("redis", "timeout_s", NAN), ("redis", "timeout_s", INF), ("redis", "timeout_s", 0), ("redis", "timeout_s", -1.0),
    ("redis", "timeout_s", True), ("redis", "timeout_s", MAX_SECONDS * 2),
    ("redis", "retry_backoff_s", NAN), ("redis", "retry_backoff_s", INF), ("redis", "retry_backoff_s", 0.0),
    ("redis", "retry_backoff_s", HUGE_INT),
    ("redis", "port", 0), ("redis", "port", 70000), ("redis", "port", True), ("redis", "db", -1),
    ("redis", "batch_pages", 0), ("redis", "batch_pages", 2.0),
    ("mooncake", "retry_backoff_s", NAN), ("mooncake", "global_segment_size", 0),
    ("mooncake", "local_buffer_size", -1), ("mooncake", "replica_num", 0), ("mooncake", "replica_num", True),
    ("file", "fsync", 1), ("file", "fsync", "yes"),
]


@pytest.mark.parametrize("backend,name,value", BACKEND_BAD_OPTIONS, ids=lambda v: repr(v)[:20])
def test_bad_backend_options_are_refused_before_opening(backend, name, value, tmp_path):
    spec = {"redis": "redis://127.0.0.1:1", "mooncake": "mooncake://127.0.0.1:1",
            "file": f"file:{tmp_path}"}[backend]
    with pytest.raises(ValueError) as err:
        open_store(spec, "ns", 64, {name: value})
    assert name in str(err.value) and repr(value) in str(err.value)


def test_backend_options_through_the_extra_config_json(tmp_path):
    from tierkv.cache.l3.controller import open_storage
    from storage_util import make_cache
    cache = make_cache()
    with pytest.raises(ValueError, match="retry_backoff_s"):
        open_storage(cache, "redis://127.0.0.1:1", '{"retry_backoff_s": NaN}', "m")
    with pytest.raises(ValueError, match="timeout_s"):
        open_storage(cache, "redis://127.0.0.1:1", '{"timeout_s": Infinity}', "m")
    assert cache.storage is None  # nothing attached by a refused config
    cache.close()


@pytest.mark.parametrize("field,value", [
    ("model", ""), ("model", 3), ("model", "\ud800"), ("extra_key", None), ("extra_key", "a\udfffb"),
    ("kv_layout", 5), ("kv_dtype", b"f16"), ("tp_size", 0), ("tp_size", True), ("tp_rank", -1),
])
def test_hash_namespace_fields_are_checked(field, value):
    with pytest.raises(ValueError) as err:
        HashNamespace(**{"model": "m", field: value})
    assert field in str(err.value)


def test_good_values_pass_and_are_normalised():
    assert check_bool("f", False) is False
    assert check_int("f", 0, minimum=0) == 0
    assert check_number("f", 3) == 3.0 and isinstance(check_number("f", 3), float)
    assert check_seconds("f", 0) == 0.0 and check_seconds("f", MAX_SECONDS) == MAX_SECONDS
    assert check_text("f", "tenant \u00e9") == "tenant \u00e9"
    # the defaults and the presets are valid
    for cls in (CacheConfig, StorageConfig, EngineConfig, ModelConfig):
        cls()
    assert json.loads(json.dumps(dataclasses.asdict(StorageConfig())))  # finite: plain JSON


@pytest.mark.parametrize("check,args", [
    (check_number, ("timeout_s", NAN)), (check_number, ("x", 0.0, 0.0, None, True)),
    (check_seconds, ("timeout_s", 0.0, True)), (check_int, ("n", 5, 0, 4)), (check_text, ("t", "", False)),
])
def test_helpers_name_the_field(check, args):
    with pytest.raises(ValueError, match=args[0]):
        check(*args)


@pytest.mark.parametrize("name,value", [
    ("hang_s", 1e300), ("hang_s", INF), ("latency_s", NAN), ("latency_s", -0.5), ("latency_s", True),
    ("error_rate", NAN), ("error_rate", 1.5), ("corrupt_get_rate", -0.1), ("partial_rate", "0.5"),
    ("seed", True), ("seed", 1.0),
], ids=lambda v: repr(v)[:20])
def test_fault_injection_options_are_checked_like_the_others(name, value):
    with pytest.raises(ValueError) as err:
        open_store("memory", "ns", 64, {"faults": {name: value}})
    assert f"faults.{name}" in str(err.value) and repr(value) in str(err.value)
