"""tierkv's L3 as SGLang's HiCache storage backend (tierkv/integrations/sglang.py) against real SGLang 0.5.23.

SGLang's server needs CUDA, but its KV pools, host pools, backend factory and cache controller's storage
calls run on CPU: tests/sglang_driver.py drives the backend through them in the SGLang venv's python (one
subprocess for every check: importing SGLang costs 10-30 s), with real tensors, real files and real Redis,
Redis Cluster and Mooncake servers started here. Each test below judges one group of the facts it reports.

The SGLang python: $TIERKV_SGLANG_PYTHON (empty: none), else .venv-sglang/bin/python
(scripts/setup_sglang_venv.sh builds it). Without one the tests skip, naming how to get it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.servers import MooncakeMaster, RedisClusterServers, RedisServer, ServerUnavailable

REPO = Path(__file__).resolve().parent.parent
NUM_PAGES = 6  # tests/sglang_driver.py writes sequences of this many pages


def _sglang_python() -> str | None:
    explicit = os.environ.get("TIERKV_SGLANG_PYTHON")
    if explicit is not None:  # scripts/test.sh sets it empty where the venv did not build
        return explicit or None
    venv = REPO / ".venv-sglang" / "bin" / "python"
    return str(venv) if venv.exists() else None


SGLANG_PYTHON = _sglang_python()
if SGLANG_PYTHON is None:
    pytest.skip("no SGLang venv: run scripts/setup_sglang_venv.sh (or set TIERKV_SGLANG_PYTHON)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@contextlib.contextmanager
def _optional(start):
    """A server for the block, or None where its binary is missing here (its checks then skip)."""
    try:
        server = start()
    except ServerUnavailable:
        yield None
        return
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang-l3")
    with _optional(RedisServer.start) as redis, _optional(RedisClusterServers.start) as cluster, \
            _optional(MooncakeMaster.start) as mooncake:
        args = {"dir": str(root),
                "redis": redis and {"storage_backend": redis.url},
                "redis_cluster": cluster and {"storage_backend": cluster.url},
                "mooncake": mooncake and {"storage_backend": mooncake.url, **mooncake.client_config()}}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([SGLANG_PYTHON, str(REPO / "tests" / "sglang_driver.py"), json.dumps(args)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    if proc.returncode != 0:
        raise AssertionError(f"sglang_driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    found = json.loads(line.removeprefix("RESULT "))
    found["driver_log"] = proc.stderr[-6000:]  # the stores' warnings: why a page was not read, if one was not
    return found


def _whole(fact: dict, driver_log: str = "") -> None:
    """Every page backed up, found, read and bit-exact."""
    assert fact["backed_up"] == fact["hit"] == fact["read"] == fact["exact"] == NUM_PAGES, f"{fact}\n{driver_log}"


def test_every_layout_and_interface_round_trips_bit_exact(facts):
    layouts = facts["layouts"]
    assert len(layouts) == 12  # MHA and MLA x layer_first, page_first, page_first_direct x both interfaces
    for name, fact in layouts.items():
        _whole(fact)
        kind, layout, _ = name.split("/")
        # page_first layouts move pages in place in the host pool: MHA as K and V, MLA as one run
        assert fact["zero_copy"] == (layout != "layer_first"), name
        assert fact["elements"] == (2 if kind == "mha" and fact["zero_copy"] else 1), name


def test_zero_copy_and_copying_interfaces_store_the_same_bytes(facts):
    for name, fact in facts["interfaces_agree"].items():
        _whole(fact)
    assert len(facts["interfaces_agree"]) == 8


def test_exists_reports_the_leading_run_of_stored_pages(facts):
    runs = facts["prefix_runs"]
    assert runs["longer"] == NUM_PAGES  # pages past the stored sequence end the run
    assert runs["diverged_at_3"] == 3  # a chained key names its whole prefix
    assert runs["unrelated"] == 0
    assert runs["hole_at_2"] == 2
    assert runs["with_prefix_keys"] == NUM_PAGES - 2  # SGLang's prefix keys are accepted and change nothing
    assert runs["empty"] == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_corrupt_pages_are_misses_never_wrong_kv(facts, layout):
    fact = facts["corrupt"][layout]
    assert fact["hit"] == NUM_PAGES  # exists reads no page: neither the flipped byte nor the broken header is seen
    assert fact["read"] == fact["exact"] == 2  # the read stops at page 2, whose V element has a flipped byte
    assert fact["corrupt_counted"] == 2  # pages 2 and 4, read in one batch from their one pack
    assert fact["hit_after"] == 2  # the corrupt page was dropped, so a backup can write it again


def test_forged_pages_are_misses_for_a_reader_with_the_page_key(facts):
    forged = facts["forged"]
    for name in ("wrong_key", "no_key"):
        assert forged[name]["backed_up"] == forged[name]["hit"] == NUM_PAGES, name
        assert forged[name]["read"] == forged[name]["exact"] == 0, name
    _whole(forged["same_key"])


def test_mha_pages_belong_to_their_tp_rank_mla_pages_to_every_rank(facts):
    mha, mla = facts["tp_naming"]["mha"], facts["tp_naming"]["mla"]
    assert mha["rank1_hit"] == 0 and mha["rank1_exact_vs_rank0"] == 0
    assert mha["rank0_own_exact"] == mha["rank1_own_exact"] == NUM_PAGES
    assert "tp=0of2" in mha["rank0_namespace"] and "tp=1of2" in mha["rank1_namespace"]
    assert mla["rank1_hit"] == mla["rank1_exact_vs_rank0"] == NUM_PAGES
    assert mla["rank0_namespace"] == mla["rank1_namespace"] and "tp=0of1" in mla["rank0_namespace"]


def test_pages_of_another_host_layout_are_misses(facts):
    assert facts["layout_isolation"] == {"layer_first": 0, "page_first": NUM_PAGES, "page_first_direct": 0}


def test_a_bounded_file_store_stays_within_max_bytes(facts):
    fact = facts["bounded"]
    assert 0 < fact["stored_bytes"] <= fact["max_bytes"]
    assert fact["hit"] == 0  # the oldest pages (the sequence's first) were evicted, so no prefix hits
    assert fact["read"] == fact["exact"]


def test_config_errors_name_the_key(facts):
    errors = facts["config_errors"]
    assert "storage_backend" in errors["missing_backend"]
    assert "'max_byte'" in errors["unknown_key"] and "'max_bytes'" in errors["unknown_key"]
    assert "interface_v1" in errors["unknown_key"]  # the list holds SGLang's keys and the store's
    assert "max_bytes" in errors["bad_type"] and "10GB" in errors["bad_type"]
    assert "s3://bucket" in errors["bad_spec"]


def test_a_page_key_on_the_command_line_is_warned_of_without_its_value(facts):
    inline, from_file = facts["secret_warning"]["inline"], facts["secret_warning"]["from_file"]
    assert len(inline) == 1 and "page_key" in inline[0] and "@/path" in inline[0]
    assert "the-real-page-key" not in inline[0]
    assert from_file == []


def test_a_config_without_interface_v1_gets_a_hint(facts):
    copying = facts["secret_warning"]["copying"]
    assert len(copying) == 1 and '"interface_v1": 1' in copying[0]


@pytest.mark.parametrize("store", ["redis", "redis_cluster", "mooncake"])
def test_remote_stores_round_trip_with_a_page_key(facts, store):
    if facts[store] is None:
        pytest.skip(f"no {store} server here (scripts/setup_env.sh installs them)")
    for kind, fact in facts[store].items():
        _whole(fact, facts["driver_log"])
