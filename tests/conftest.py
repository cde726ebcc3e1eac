"""Shared fixtures: real servers (redis-server, mooncake_master) started on 127.0.0.1 for the session."""

import os

import pytest

from tierkv.copy import cpu_copy
from tierkv.pools import allocator
from tests.servers import MooncakeMaster, RedisServer, running


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server on a free port with no persistence; ``.url``, ``.port``, ``.pid``, ``.restart()``."""
    with running(RedisServer.start) as server:
        yield server


@pytest.fixture(scope="session")
def mooncake_master():
    """A mooncake_master on free ports with its HTTP metadata server; ``.url``, ``.client_config()``."""
    with running(MooncakeMaster.start) as server:
        yield server


def skip_without_native(reason: str) -> None:
    """Skip a test of a native part that is not built; fail instead under TIERKV_REQUIRE_NATIVE=1."""
    if os.environ.get("TIERKV_REQUIRE_NATIVE") == "1":
        pytest.fail(f"{reason} (TIERKV_REQUIRE_NATIVE=1)")
    pytest.skip(reason)


@pytest.fixture(params=["native", "torch"])
def cpu_copy_impl(request, monkeypatch):
    """Run a copy test against the native chunk copy and against the torch fallback (same bytes)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_copy, "native", None)
    elif not cpu_copy.native_available():
        skip_without_native("tierkv.copy._rowcopy is not built")
    return request.param


@pytest.fixture(params=["native", "numpy"])
def allocator_impl(request, monkeypatch):
    """Run a slot allocator test against its native checks (tierkv/copy/_rowcopy.c) and its numpy reference."""
    if request.param == "numpy":
        monkeypatch.setattr(allocator, "native", None)
    elif allocator.native is None:
        skip_without_native("tierkv.copy._rowcopy is not built")
    return request.param


@pytest.fixture(params=["c", "python"])
def tree_impl(request, monkeypatch):
    """Run a tree test against the compiled key packing, comparison and eviction loop (tierkv/_radix.c)
    and the pure-Python reference (keys and trees built inside the test pick it up)."""
    from tierkv import radix, radix_key
    from tierkv.eviction import heap

    if request.param == "python":
        monkeypatch.setattr(radix, "native_common_prefix_len", None)
        monkeypatch.setattr(radix_key, "native_pack_int64", None)
        monkeypatch.setattr(heap, "native_evict_device", None)
    elif radix.native_common_prefix_len is None:
        if os.environ.get("TIERKV_REQUIRE_NATIVE") == "1":
            pytest.fail("tierkv._radix is not built (TIERKV_REQUIRE_NATIVE=1)")
        pytest.skip("tierkv._radix is not built, or TIERKV_PURE_PYTHON_TREE=1")
    return request.param


REAL_VLLM_MODULES = ("test_vllm_connector.py",)


def pytest_collection_modifyitems(config, items):
    """TIERKV_SKIP_VLLM=1 (scripts/test.sh's opt-out of the 3.5 GB vLLM venv) skips the real-vLLM tests, by name."""
    if os.environ.get("TIERKV_SKIP_VLLM") != "1":
        return
    marker = pytest.mark.skip(reason="TIERKV_SKIP_VLLM=1: the real-vLLM connector tests are skipped")
    for item in items:
        if item.path.name in REAL_VLLM_MODULES:
            item.add_marker(marker)
