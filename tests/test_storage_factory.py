import pytest

from tierkv.storage.factory import BACKEND_OPTIONS, open_store, parse_spec
from tierkv.storage.file import FileStore
from tierkv.storage.memory import MemoryStore


@pytest.mark.parametrize("spec, backend, options", [
    ("memory", "memory", {}),
    ("file", "file", {}),
    ("file:///var/cache/l3", "file", {"dir": "/var/cache/l3"}),
    ("file:rel/dir", "file", {"dir": "rel/dir"}),
    ("redis", "redis", {}),
    ("redis://10.0.0.5:6380/2", "redis", {"host": "10.0.0.5", "port": 6380, "db": 2}),
    ("redis://:s3cret@host:7000/0", "redis", {"host": "host", "port": 7000, "password": "s3cret", "db": 0}),
    ("redis://bob:pw@host:7000", "redis",
     {"host": "host", "port": 7000, "username": "bob", "password": "pw"}),
    ("valkey://host:7000", "redis", {"host": "host", "port": 7000}),
    ("mooncake://127.0.0.1:50051", "mooncake", {"master": "127.0.0.1:50051"}),
])
def test_specs_by_name_and_url(spec, backend, options):
    assert parse_spec(spec) == (backend, options)


@pytest.mark.parametrize("spec, match", [
    ("s3://bucket", "not one of"), ("nfs", "not one of"), ("", "non-empty"),
    ("file://otherhost/dir", "host"), ("redis://h:1/x", "db"), ("mooncake://nohost", "master_host:port"),
])
def test_bad_specs_are_value_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_open_memory_and_file(tmp_path):
    assert isinstance(open_store("memory", "ns", 64), MemoryStore)
    store = open_store("file", "ns", 64, {"dir": str(tmp_path), "fsync": True})
    assert isinstance(store, FileStore) and store.fsync and store.root == str(tmp_path)
    # extra_config overrides the URL
    assert open_store("file:///nonexistent-ignored", "ns", 64, {"dir": str(tmp_path)}).root == str(tmp_path)


@pytest.mark.parametrize("spec, extra, match", [
    ("memory", {"dir": "/tmp"}, "unknown memory storage option 'dir'"),
    ("file", {"dir": "/tmp", "fsync": "yes"}, "'fsync' must be bool"),
    ("file", {"dir": 5}, "'dir' must be str"),
    ("file", {}, "needs a directory"),
    ("redis", {"port": "6379"}, "'port' must be int"),
    ("redis", {"port": True}, "'port' must be int"),
    ("redis", {"timeout_s": "1"}, "'timeout_s' must be float"),
    ("redis", {"pasword": "x"}, "unknown redis storage option 'pasword'"),
    ("mooncake", {"replica_num": 1.5}, "'replica_num' must be int"),
    ("mooncake", {}, "needs a master"),
])
def test_unknown_keys_and_wrong_types_name_the_key(spec, extra, match):
    with pytest.raises(ValueError, match=match):
        open_store(spec, "ns", 64, extra)


def test_wrong_password_type_does_not_echo_it():
    with pytest.raises(ValueError) as err:
        open_store("redis", "ns", 64, {"password": 12345678})
    assert "12345678" not in str(err.value)


def test_every_backend_has_an_options_table():
    assert set(BACKEND_OPTIONS) == {"memory", "file", "redis", "mooncake"}


def test_open_redis_is_lazy_and_validates():
    from tierkv.storage.redis_store import RedisStore
    store = open_store("redis://:pw@10.255.255.1:7001/5", "ns", 64, {"key_prefix": "app:", "timeout_s": 2})
    assert isinstance(store, RedisStore) and store.address == "10.255.255.1:7001/5"
    assert store.key_prefix.startswith("app:") and "pw" not in store.address
    with pytest.raises(ValueError, match="key_prefix"):
        open_store("redis", "ns", 64, {"key_prefix": "a*"})
    with pytest.raises(ValueError, match="timeout_s"):
        open_store("redis", "ns", 64, {"timeout_s": 0})
