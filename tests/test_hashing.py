import hashlib

import pytest
import torch

from hypothesis import given, strategies as st

from tierkv.hashing import (HASH_ALGORITHMS, HashNamespace, hash_function, page_hashes, request_extra_key,
                            token_bytes)
from tierkv.pools.spec import KVSpec

NS = HashNamespace(model="llama-3-8b", kv_layout="mha/page_first", kv_dtype="float16",
                   kv_shape=(2, 32, 8, 128))


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_keys_are_hex_of_the_algorithms_width(algorithm):
    ns = HashNamespace(model="m", algorithm=algorithm)
    keys = page_hashes(list(range(40)), 16, None, ns)
    width = {"sha256": 64, "xxh3_128": 32}[algorithm]
    assert len(keys) == 2  # the trailing 8 tokens are not a whole page
    assert all(len(k) == width and int(k, 16) >= 0 for k in keys)


def test_first_page_is_sha256_of_seed_and_tokens():
    tokens = list(range(16))
    expected = hashlib.sha256(bytes.fromhex(NS.seed()) + token_bytes(tokens)).hexdigest()
    assert page_hashes(tokens, 16, None, NS) == [expected]


def test_chain_continues_from_the_parent_hash():
    tokens = list(range(100, 164))
    whole = page_hashes(tokens, 16, None, NS)
    parent = page_hashes(tokens[:32], 16, None, NS)
    child = page_hashes(tokens[32:], 16, parent[-1], NS)
    assert parent + child == whole


def test_a_page_hash_names_its_whole_prefix():
    a = page_hashes([1] * 16 + [7] * 16, 16, None, NS)
    b = page_hashes([2] * 16 + [7] * 16, 16, None, NS)
    assert a[1] != b[1]  # same tokens in page 1, different prefix


@pytest.mark.parametrize("change", [
    {"model": "qwen"}, {"extra_key": "tenant-b"}, {"kv_layout": "mha/layer_first"}, {"kv_dtype": "bfloat16"},
    {"kv_shape": (2, 32, 4, 128)}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"algorithm": "xxh3_128"},
])
def test_every_namespace_field_changes_every_key(change):
    tokens = list(range(32))
    fields = {**NS.__dict__, **change}
    other = HashNamespace(**fields)
    assert other.seed() != NS.seed()
    assert not set(page_hashes(tokens, 16, None, other)) & set(page_hashes(tokens, 16, None, NS))


def test_for_spec_distinguishes_tp_shards_and_mla():
    spec = KVSpec(num_layers=4, kv_heads=8, head_dim=64, dtype=torch.bfloat16)
    full = HashNamespace.for_spec("m", spec, "page_first")
    shard = HashNamespace.for_spec("m", spec.shard(0, 2), "page_first", tp_rank=0, tp_size=2)
    mla = HashNamespace.for_spec("m", KVSpec(num_layers=4, attention="mla", kv_lora_rank=64, rope_dim=16),
                                 "page_first")
    assert len({full.seed(), shard.seed(), mla.seed()}) == 3
    assert full.kv_dtype == "bfloat16" and full.kv_shape == (2, 4, 8, 64)


def test_bigram_pages_never_hash_like_flat_pages():
    flat = page_hashes([1, 2, 3, 4], 2, None, NS)
    pairs = page_hashes([(1, 2), (3, 4)], 1, None, NS)
    assert len(flat) == len(pairs) == 2 and not set(flat) & set(pairs)


def test_unknown_algorithm_and_bad_fields_are_value_errors():
    with pytest.raises(ValueError, match="md5"):
        hash_function("md5")
    with pytest.raises(ValueError, match="md5"):
        HashNamespace(model="m", algorithm="md5")
    with pytest.raises(ValueError, match="tp_rank"):
        HashNamespace(model="m", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="model"):
        HashNamespace(model="")
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0, None, NS)


@pytest.mark.parametrize("pairs", [False, True])
def test_every_page_hashes_its_own_tagged_token_bytes(pairs):
    tokens = [7 * i - 300 for i in range(53)]
    if pairs:
        tokens = list(zip(tokens, tokens[1:]))
    prior, expected = NS.seed(), []
    for start in range(0, len(tokens) - 3 + 1, 3):  # the definition, one page at a time
        prior = hashlib.sha256(bytes.fromhex(prior) + token_bytes(tokens[start:start + 3])).hexdigest()
        expected.append(prior)
    assert page_hashes(tokens, 3, None, NS) == expected
    assert page_hashes(tokens[:2], 3, None, NS) == []


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("bigram", [False, True])
def test_batched_chain_equals_the_definition_page_by_page(algorithm, page_size, bigram):
    """Format v2 unchanged: hash(page_i) = H(bytes of hash(page_i-1), token_bytes(page_i)), hex."""
    ns = HashNamespace(model="m", extra_key="t", algorithm=algorithm)
    tokens = [(t * 7919) % 50_000 for t in range(10 * page_size + 2)]
    if bigram:
        tokens = [(a, b) for a, b in zip(tokens, tokens[1:])]
    digest = hash_function(algorithm)
    prior, expected = ns.seed(), []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = digest(bytes.fromhex(prior) + token_bytes(tokens[start:start + page_size]))
        expected.append(prior)
    assert page_hashes(tokens, page_size, None, ns) == expected
    assert page_hashes(tokens[page_size:], page_size, expected[0], ns) == expected[1:]


# ---- a request's namespace from its tenant and cache_salt ------------------------------------------------
# pieces of the encodings themselves, so that random fields imitate each other's separators
_PIECES = st.sampled_from(["", "a", "b", "|", ":", "+", "1", "12:", "salt:", "tenant:", "tenant+salt:", "|salt:"])
_FIELD = st.none() | st.lists(_PIECES | st.text(max_size=3), max_size=4).map("".join)


def test_a_tenant_and_a_salt_never_meet_a_tenant_named_like_both():
    assert request_extra_key("a", "b") != request_extra_key("a|salt:b", None)
    assert request_extra_key("a", "b") != request_extra_key("a|salt:", "b")
    assert request_extra_key(None, None) is None
    # the single-field namespaces are unchanged: their pages stay reachable
    assert (request_extra_key("a", None), request_extra_key(None, "b")) == ("tenant:a", "salt:b")


@given(first=st.tuples(_FIELD, _FIELD), second=st.tuples(_FIELD, _FIELD))
def test_no_two_tenant_salt_pairs_share_a_namespace(first, second):
    if first != second:
        assert request_extra_key(*first) != request_extra_key(*second)


@pytest.mark.parametrize("tokens", [list(range(16 * 9 + 5)), [[t, t + 1] for t in range(16 * 4)]],
                         ids=["flat", "pairs"])
@pytest.mark.parametrize("prior", [None, "0f" * 16], ids=["seed", "prior"])
def test_the_native_xxh3_128_chain_gives_the_python_loops_keys(monkeypatch, tokens, prior):
    # the chain runs in one native call (tierkv._pageio.chain_xxh3_128): ~0.5 us a page less in a replay
    import xxhash

    from tests.conftest import skip_without_native
    from tierkv.storage import native

    if native.pageio is None:
        skip_without_native("tierkv._pageio is not built")
    ns = HashNamespace(model="m", algorithm="xxh3_128")
    fast = page_hashes(tokens, 16, prior, ns)
    monkeypatch.setattr(native, "pageio", None)
    assert fast == page_hashes(tokens, 16, prior, ns) and len(fast) == len(tokens) // 16
    # the Python loop's first link, spelt out
    start = bytes.fromhex(prior if prior is not None else ns.seed())
    assert fast[0] == xxhash.xxh3_128_hexdigest(start + token_bytes(tokens[:16]))
