"""RadixKey: the token id forms callers pass are accepted as ints; everything else is refused by name."""

import json
from array import array

import numpy as np
import pytest
import torch

from tierkv.radix import RadixKey, RadixTree

pytestmark = pytest.mark.usefixtures("tree_impl")  # every test: compiled and pure-Python tree

GOOD = [
    [5, 6, 7], (5, 6, 7), range(5, 8), array("q", [5, 6, 7]), array("i", [5, 6, 7]), np.array([5, 6, 7]),
    np.array([5, 6, 7], dtype=np.int32), np.array([5, 6, 7], dtype=np.uint16), torch.tensor([5, 6, 7]),
    torch.tensor([5, 6, 7], dtype=torch.int32), [np.int64(5), np.int32(6), 7],
]


@pytest.mark.parametrize("ids", GOOD, ids=lambda ids: type(ids).__name__)
def test_accepted_forms_become_an_int64_array(ids):
    key = RadixKey(ids)
    assert key.token_ids == array("q", [5, 6, 7]) and all(type(t) is int for t in key.token_ids)
    tree = RadixTree()
    tree.insert(RadixKey([5, 6, 7]), [0, 1, 2])
    assert tree.match(key).num_tokens == 3


BAD = [
    ({5, 6, 7}, "set"), (frozenset({5}), "frozenset"), ({5: 1, 6: 2}, "dict"), ({}.keys(), "dict_keys"),
    ([5, True, 7], "True"), ([False], "False"), ([5, 6.0], "6.0"), ([5, "6"], "'6'"), ([5, None], "None"),
    ([np.bool_(True)], "True"), ([2 ** 63], "64-bit"), ("567", "str"), (b"\x05\x06", "bytes"), (5, "int"),
    (np.array([5.0, 6.0]), "float64"), (np.array([True, False]), "bool"), (torch.tensor([1.0]), "float32"),
    (torch.tensor([True]), "bool"), (np.array([[5, 6]]), "2 dims"), (iter([5, 6]), "iterator"),
]


@pytest.mark.parametrize("ids,needle", BAD, ids=lambda v: type(v).__name__ if not isinstance(v, str) else v)
def test_other_token_ids_are_a_type_error_naming_the_value(ids, needle):
    with pytest.raises(TypeError, match="token_ids|token ids") as err:
        RadixKey(ids)
    assert needle in str(err.value)


@pytest.mark.parametrize("extra_key", [json.loads('"\\ud800"'), "tenant-\udcff", "\ud83d"])
def test_extra_key_not_encodable_as_utf8_is_a_value_error_naming_it(extra_key):
    with pytest.raises(ValueError, match="extra_key") as err:
        RadixKey([1, 2, 3], extra_key)
    assert repr(extra_key) in str(err.value)


@pytest.mark.parametrize("extra_key", [3, b"tenant", ["t"]])
def test_extra_key_of_another_type_is_a_type_error(extra_key):
    with pytest.raises(TypeError, match="extra_key"):
        RadixKey([1], extra_key)


@pytest.mark.parametrize("extra_key", [None, "", "tenant \u00e9", "\U0001f600"])
def test_valid_extra_keys_are_kept(extra_key):
    assert RadixKey([1], extra_key).extra_key == extra_key


def test_an_int64_array_is_adopted_but_the_tree_keeps_its_own_copy():
    """SGLang's scheduler hands over array('q') keys: no copy of the prompt per key, yet no node may
    share the caller's buffer."""
    ids = array("q", [5, 6, 7, 8])
    key = RadixKey(ids)
    assert key.token_ids is ids
    for page_size in (1, 2):
        tree = RadixTree(page_size)
        leaf = tree.insert(key, [0, 1, 2, 3]).new_node
        assert leaf.key is not ids and leaf.key == ids


def test_native_packing_takes_plain_ints_only_and_leaves_the_rest_to_the_reference():
    from tierkv import radix_key

    pack = radix_key.native_pack_int64
    if pack is None:
        pytest.skip("tierkv._radix is not built")
    ids = [0, 1, -1, 2**63 - 1, -(2**63), 31999]
    assert array("q", pack(ids)) == array("q", ids) == array("q", pack(tuple(ids)))
    for odd in ([1, True], [1, np.int64(2)], [1, 2.0], [2**63], [-(2**63) - 1], [1, None]):
        assert pack(odd) is None
    assert pack([]) == b""


def test_a_stale_native_build_leaves_the_pure_python_tree(monkeypatch, caplog):
    """A _radix build from another checkout (no API_VERSION, no evict_device) is ignored, not called."""
    import sys
    import types

    import tierkv
    from tierkv import radix_key

    stale = types.ModuleType("tierkv._radix")
    stale.common_prefix_len = lambda a, b, offset: 0
    monkeypatch.setitem(sys.modules, "tierkv._radix", stale)
    monkeypatch.setattr(tierkv, "_radix", stale, raising=False)
    monkeypatch.delenv("TIERKV_PURE_PYTHON_TREE", raising=False)
    assert radix_key.load_native("common_prefix_len") is None
    assert radix_key.load_native("evict_device") is None
    assert "API version 1" in caplog.text
