"""Isolation and hygiene: namespaces never read each other's pages (tried on every backend), the file
backend stays inside its directory, stored bytes are never unpickled or evaluated, and the Redis
password works but never shows in logs, reprs or errors."""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.servers import RedisServer, running
from tests.workload import WORK_PAGE, WORK_SPEC, make_cache, make_trace, serve
from tierkv.hashing import HashNamespace, page_hashes
from tierkv.radix import RadixKey
from tierkv.storage.base import check_key
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import open_store
from tierkv.storage.file import FileStore
from tierkv.storage.file_pack import pack_name

PAGE_NBYTES = WORK_PAGE * WORK_SPEC.bytes_per_token
BASE = HashNamespace.for_spec("model-a", WORK_SPEC, "page_first")
VARIANTS = {
    "model": HashNamespace.for_spec("model-b", WORK_SPEC, "page_first"),
    "tenant": HashNamespace.for_spec("model-a", WORK_SPEC, "page_first", extra_key="tenant-b"),
    "tp_layout": HashNamespace.for_spec("model-a", WORK_SPEC, "page_first", tp_rank=1, tp_size=2),
    "host_layout": HashNamespace.for_spec("model-a", WORK_SPEC, "layer_first"),
}


@pytest.fixture(params=["memory", "file", "redis"])
def location(request, tmp_path):
    """Opens stores that share one physical place (dict, directory, redis db + prefix)."""
    if request.param == "memory":
        blobs: dict = {}  # shared, as one store process would hold it
        return lambda ns: _memory(ns, blobs)
    if request.param == "file":
        return lambda ns: open_store(f"file://{tmp_path}/l3", ns, PAGE_NBYTES)
    server = request.getfixturevalue("redis_server")
    prefix = f"iso-{uuid.uuid4().hex[:8]}:"
    return lambda ns: open_store(server.url, ns, PAGE_NBYTES, {"key_prefix": prefix, "timeout_s": 2.0})


def _memory(namespace: str, blobs: dict):
    from tierkv.storage.memory import MemoryStore
    return MemoryStore(namespace, PAGE_NBYTES, blobs=blobs)


def pages(num_pages: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE_NBYTES,), dtype=torch.uint8, generator=gen) for _ in range(num_pages)]


def raw_copy(src, dst, key: str) -> None:
    """Copy the stored blob of ``key`` from ``src``'s place to ``dst``'s, bypassing the store API."""
    if hasattr(src, "blobs"):
        dst.blobs[dst._slot(key)] = bytearray(src.blobs[src._slot(key)])
    elif isinstance(src, FileStore):  # the whole pack, under a number the reader will look for
        os.makedirs(dst.directory, exist_ok=True)
        shutil.copyfile(src.path(key), os.path.join(dst.directory, pack_name(dst._counter.draw())))
    else:
        src.client.copy(src.redis_key(key), dst.redis_key(key), replace=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_tokens_in_another_namespace_hash_apart(variant):
    tokens = list(range(8 * WORK_PAGE))
    assert not set(page_hashes(tokens, WORK_PAGE, None, BASE)) & set(
        page_hashes(tokens, WORK_PAGE, None, VARIANTS[variant]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_store_never_reads_another_namespace(location, variant):
    mine, theirs = location(BASE.name()), location(VARIANTS[variant].name())
    keys = page_hashes(list(range(4 * WORK_PAGE)), WORK_PAGE, None, BASE)
    written = pages(4, seed=1)
    assert mine.batch_set(keys, written) == [True] * 4
    # the same keys asked of the other namespace: absent
    assert theirs.batch_exists(keys) == 0
    targets = pages(4, seed=2)
    assert theirs.batch_get(keys, targets) == [False] * 4
    # even the raw blobs copied into the other namespace's place are refused (header names the namespace)
    for key in keys:
        raw_copy(mine, theirs, key)
    assert theirs.batch_get(keys, targets) == [False] * 4
    assert theirs.stats.corrupt_pages == 4
    got = pages(4, seed=3)
    assert mine.batch_get(keys, got) == [True] * 4 and all(map(torch.equal, got, written))
    mine.clear()
    theirs.clear()


@pytest.mark.parametrize("extra_key", [None, "tenant-b"])
def test_a_tenant_never_gets_another_tenants_kv_end_to_end(tmp_path, extra_key):
    """Tenant A fills L3; tenant B (same tokens) on a fresh cache over the same directory gets no L3 hit."""
    trace = [RadixKey(k.token_ids, "tenant-a") for k in make_trace(num_requests=8, seed=3)]
    writer_store = open_store(f"file://{tmp_path}", BASE.name(), PAGE_NBYTES)
    writer = make_cache(writer_store, io_wait_timeout_s=30.0)
    for i, key in enumerate(trace):
        serve(writer, key, f"w{i}")
        writer.flush()  # every backup lands in L3 however loaded the machine is
    writer.close()
    assert writer_store.stats.set_pages > 0

    reader = make_cache(open_store(f"file://{tmp_path}", BASE.name(), PAGE_NBYTES), io_wait_timeout_s=30.0)
    for i, key in enumerate(trace):
        serve(reader, RadixKey(key.token_ids, extra_key), f"r{i}")  # serve() verifies every hit's KV
        reader.flush()  # backups in flight protect L2 pages: drained, a prefetch always finds room
    assert reader.stats.storage_hit_tokens == 0
    # the tenant itself does get its pages back: the test can see L3 hits when they are allowed
    for i, key in enumerate(trace):
        serve(reader, key, f"a{i}")
        reader.flush()
    assert reader.stats.storage_hit_tokens > 0 and reader.storage.stats.prefetch_no_room == 0
    reader.close()


# ---- the file backend stays inside its directory ---------------------------------------------------------
@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "..", "a/../../b", "ab" * 8 + "/..",
                                 "0" * 15, "G" * 64, "0" * 129, "", "00/../../" + "0" * 32, "0" * 32 + "\x00"])
def test_file_backend_refuses_keys_that_could_leave_its_directory(tmp_path, key):
    store = FileStore("ns", PAGE_NBYTES, root=str(tmp_path / "l3"))
    with pytest.raises(ValueError):
        store.path(key)
    with pytest.raises(ValueError):
        store.batch_set([key], pages(1, seed=0))
    with pytest.raises(ValueError):
        store.batch_get([key], pages(1, seed=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l3"]


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=80) | st.binary(max_size=40).map(lambda b: b.hex()))
def test_any_accepted_key_maps_inside_the_directory(tmp_path_factory, key):
    root = tmp_path_factory.getbasetemp() / "fuzz-l3"
    store = FileStore("ns", PAGE_NBYTES, root=str(root))
    try:
        check_key(key)
    except ValueError:
        return
    assert store.batch_set([key], pages(1, seed=0)) == [True]
    path = Path(store.path(key))
    assert path.resolve().is_relative_to(Path(store.directory).resolve())
    store.close()


# ---- stored bytes are data, never code -------------------------------------------------------------------
UNSAFE = re.compile(r"\b(pickle|cPickle|marshal|shelve|dill|cloudpickle)\b|(?<![.\w])(eval|exec)\s*\(|"
                    r"torch\.load\s*\(|allow_pickle\s*=\s*True|yaml\.(unsafe_)?load\s*\(|__import__\s*\(")


def test_no_pickle_eval_or_marshal_in_the_package():
    package = Path(__file__).resolve().parents[1] / "tierkv"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if UNSAFE.search(code):
                offenders.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_unsafe_pattern_catches_what_it_must():
    for bad in ["import pickle", "x = pickle.loads(b)", "eval(s)", "exec(code)", "marshal.loads(b)",
                "torch.load(f)", "np.load(f, allow_pickle=True)", "yaml.load(s)"]:
        assert UNSAFE.search(bad), bad
    for fine in ["model.eval()", "lm.to(device).eval()", "evaluate(x)", "pickled_count = 0"]:
        assert not UNSAFE.search(fine), fine


# ---- the Redis password ----------------------------------------------------------------------------------
SECRET = "s3cret-" + uuid.uuid4().hex


@pytest.fixture
def redis_with_password():
    with running(lambda: RedisServer.start(password=SECRET)) as server:
        yield server


def test_redis_password_works_and_never_shows(redis_with_password, caplog):
    caplog.set_level(logging.DEBUG)
    server = redis_with_password
    keys = page_hashes(list(range(2 * WORK_PAGE)), WORK_PAGE, None, BASE)
    seen: list[str] = []

    store = open_store(server.url, BASE.name(), PAGE_NBYTES, {"timeout_s": 2.0})
    assert store.batch_set(keys, pages(2, seed=4)) == [True, True]
    assert store.batch_exists(keys) == 2
    seen += [repr(store), str(vars(store)), repr(store.stats)]
    store.close()

    # by extra config instead of the URL, and through the controller's JSON config
    config = StorageConfig.from_dict({"password": SECRET, "port": server.port}, backend_keys=["password", "port"])
    seen.append(repr(config))
    store = open_store("redis", BASE.name(), PAGE_NBYTES, dict(config.backend_config))
    assert store.batch_exists(keys) == 2
    store.close()

    # a wrong or missing password: counted errors and misses, never raised, never echoed
    for url in (server.url.replace(SECRET, SECRET[::-1]), f"redis://127.0.0.1:{server.port}/0"):
        bad = open_store(url, BASE.name(), PAGE_NBYTES, {"timeout_s": 2.0})
        assert bad.batch_exists(keys) == 0 and bad.stats.errors == 1
        seen += [repr(bad), str(vars(bad))]
        bad.close()

    # configuration errors name the field, not the secret
    for spec, extra in [(server.url.replace("/0", "/x"), None), (server.url.replace("redis", "rediss"), None),
                        ("redis", {"password": 123456}), (server.url, {"pasword": SECRET})]:
        with pytest.raises(ValueError) as info:
            open_store(spec, BASE.name(), PAGE_NBYTES, extra)
        seen.append(str(info.value))
    with pytest.raises(redis.AuthenticationError) as info:  # the library's own error, for comparison
        redis.Redis(port=server.port, password=SECRET[::-1]).ping()
    seen.append(str(info.value))

    seen.append(caplog.text)
    assert caplog.records, "the failures above should have been logged"
    leaks = [text for text in seen if SECRET in text or SECRET[::-1] in text]
    assert not leaks, leaks
