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
    ("redis+cluster://:pw@host:7000", "redis_cluster", {"host": "host", "port": 7000, "password": "pw"}),
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
    assert set(BACKEND_OPTIONS) == {"memory", "file", "redis", "redis_cluster", "mooncake"}


def test_open_redis_is_lazy_and_validates():
    from tierkv.storage.redis_store import RedisStore
    store = open_store("redis://:pw@10.255.255.1:7001/5", "ns", 64, {"key_prefix": "app:", "timeout_s": 2})
    assert isinstance(store, RedisStore) and store.address == "10.255.255.1:7001/5"
    assert store.key_prefix.startswith("app:") and "pw" not in store.address
    with pytest.raises(ValueError, match="key_prefix"):
        open_store("redis", "ns", 64, {"key_prefix": "a*"})
    with pytest.raises(ValueError, match="timeout_s"):
        open_store("redis", "ns", 64, {"timeout_s": 0})


def test_page_key_from_the_extra_config_or_a_key_file(tmp_path, monkeypatch):
    import torch
    key_file = tmp_path / "page.key"
    key_file.write_bytes(b"key-from-a-file-0123456789\n")
    monkeypatch.setenv("TIERKV_PAGE_KEY_FILE", str(key_file))
    from_file = open_store(f"file:{tmp_path}/l3", "ns", 64)
    assert from_file.format.page_key == b"key-from-a-file-0123456789"  # stripped of the newline
    assert open_store("memory", "ns", 64, {"page_key": "key-in-the-config-json"}).format.page_key == \
        b"key-in-the-config-json"  # the extra config wins over the file
    page, key = torch.arange(64, dtype=torch.uint8), "ab" * 32
    assert from_file.batch_set([key], [page]) == [True]
    monkeypatch.delenv("TIERKV_PAGE_KEY_FILE")
    assert open_store(f"file:{tmp_path}/l3", "ns", 64).batch_get([key], [torch.zeros(64, dtype=torch.uint8)]) \
        == [False]  # a store without the key cannot check the MAC: a miss
    with_faults = open_store(f"file:{tmp_path}/l3", "ns", 64, {"page_key": "k" * 16, "faults": {}})
    assert with_faults.format.keyed and not with_faults.inner.format.keyed


def test_bad_page_keys_are_refused_and_never_shown(tmp_path, monkeypatch):
    for bad in ("too-short", 1234567890123456789):
        with pytest.raises(ValueError, match="page_key") as err:
            open_store("memory", "ns", 64, {"page_key": bad})
        assert str(bad) not in str(err.value)
    monkeypatch.setenv("TIERKV_PAGE_KEY_FILE", str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="TIERKV_PAGE_KEY_FILE"):
        open_store("memory", "ns", 64)
