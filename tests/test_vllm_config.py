"""The vLLM connector's configuration without vLLM: one check of every key, secrets kept out of vLLM's log,
and an L2 that must fit in free host memory (with the seed's reserve) before anything is allocated."""

from __future__ import annotations

import logging

import pytest

from tierkv.integrations import vllm_config
from tierkv.integrations.vllm_config import ConnectorConfig, check_host_memory, valid_keys, validate
from tierkv.pools.kv import available_host_memory_bytes

KEY = "k" * 40
GB = 1e9


# ---- item 2: L2 against free host memory ------------------------------------------------------------
def test_an_l2_larger_than_free_memory_fails_naming_both_sizes():
    available = available_host_memory_bytes()
    config = ConnectorConfig(hicache_ratio=2.0, host_memory_reserve_gb=0)
    with pytest.raises(ValueError) as err:
        check_host_memory(config, 2 * available, available)
    message = str(err.value)
    assert f"L2 of {2 * available / GB:.2f} GB" in message and "hicache_ratio=2.0" in message
    assert "GB is available" in message and f"KV cache of {available / GB:.2f} GB" in message
    check_host_memory(config, 1 << 20, available)  # 1 MiB fits


def test_the_reserve_and_vllms_own_host_kv_count():
    config = ConnectorConfig(hicache_ratio=2.0, host_memory_reserve_gb=4)
    check_host_memory(config, int(4 * GB), int(2 * GB), kv_on_host=False, available_bytes=int(9 * GB))
    with pytest.raises(ValueError, match="keeps 4.00 GB of it free"):  # 4 + 4 reserved > 7
        check_host_memory(config, int(4 * GB), int(2 * GB), available_bytes=int(7 * GB))
    with pytest.raises(ValueError, match=r"plus vLLM's own KV cache of 2.00 GB, also in host memory.*at most 3.00"):
        check_host_memory(config, int(4 * GB), int(2 * GB), kv_on_host=True, available_bytes=int(9 * GB))


def test_the_default_reserve_is_the_seeds_10_gib():
    assert ConnectorConfig().host_memory_reserve_gb * GB == 10 * 2**30
    available = available_host_memory_bytes()
    with pytest.raises(ValueError, match="hicache_size_gb"):
        validate({"hicache_size_gb": available / GB})  # fits alone, not with 10 GiB kept free
    with pytest.raises(ValueError, match="host_memory_reserve_gb"):
        validate({"host_memory_reserve_gb": -1})


# ---- item 3: secrets ----------------------------------------------------------------------------------
@pytest.fixture
def warnings_seen(caplog):
    vllm_config._warned_inline.clear()
    caplog.set_level(logging.WARNING, logger="tierkv.integrations.vllm_config")
    return caplog


def test_secrets_from_a_file_or_a_variable_without_warning(tmp_path, monkeypatch, warnings_seen):
    key_file = tmp_path / "page.key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("L3_URL", "redis://:s3cret@127.0.0.1:6379/0")
    monkeypatch.setenv("L3_PASSWORD", "0ther")
    config = validate({"storage_backend_env": "L3_URL", "page_key_file": str(key_file),
                       "password_env": "L3_PASSWORD"})
    assert config.storage_backend == "redis://:s3cret@127.0.0.1:6379/0"
    assert config.storage.backend_config == {"page_key": KEY, "password": "0ther"}
    assert "s3cret" not in repr(config) and KEY not in repr(config) and "0ther" not in repr(config)
    assert not warnings_seen.records


def test_an_inline_secret_is_warned_about_once_without_its_value(warnings_seen):
    extra = {"storage_backend": "redis://:s3cret@127.0.0.1:6379/0", "page_key": KEY}
    for _ in range(3):
        validate(extra)
    messages = [r.getMessage() for r in warnings_seen.records]
    assert len(messages) == 2  # one per secret, once per process
    assert all("_file" in m and "_env" in m for m in messages)
    assert not any("s3cret" in m or KEY in m for m in messages)
    validate({"storage_backend": "file:///tmp/tierkv-l3"})  # a URL without a password is no secret
    assert len(warnings_seen.records) == 2


@pytest.mark.parametrize("extra, match", [
    ({"storage_backend": "file:///x", "page_key_env": "TIERKV_TEST_UNSET"}, "'TIERKV_TEST_UNSET' is not set"),
    ({"storage_backend": "file:///x", "page_key_file": "/nonexistent/key"}, "cannot read '/nonexistent/key'"),
    ({"storage_backend": "file:///x", "page_key_file": "/dev/null"}, "is empty"),
    ({"storage_backend": "file:///x", "page_key": KEY, "page_key_env": "X"}, "both 'page_key' and 'page_key_env'"),
    ({"storage_backend": "file:///x", "page_key": "short"}, "at least"),
])
def test_bad_secret_sources_name_the_source_not_the_value(extra, match):
    with pytest.raises(ValueError, match=match) as err:
        validate(extra)
    assert KEY not in str(err.value)


# ---- item 4: one check of every key, one list of every key ---------------------------------------------
def test_an_unknown_key_lists_every_valid_key():
    with pytest.raises(ValueError) as err:
        validate({"hicache_rato": 2.0})
    message = str(err.value)
    assert "did you mean 'hicache_ratio'" in message
    for key in ("hicache_ratio", "eviction_policy", "model_tag", "stats_path", "page_key_file",
                "host_memory_reserve_gb", "prefetch_threshold", "io_wait_timeout_s", "storage_backend_env"):
        assert key in message
    assert set(valid_keys(None)) < set(valid_keys("file"))


def test_backend_keys_are_checked_up_front():
    with pytest.raises(ValueError, match="did you mean 'fsync'"):
        validate({"storage_backend": "file:///x", "fsyncc": True})
    with pytest.raises(ValueError, match="'fsync' must be bool"):
        validate({"storage_backend": "file:///x", "fsync": "yes"})
    with pytest.raises(ValueError, match="set storage_backend first"):
        validate({"dir": "/x"})
    with pytest.raises(ValueError, match="must be an object"):
        validate(["hicache_ratio"])
