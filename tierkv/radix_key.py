"""Tree keys: a request's token ids (stored as ``array('q')``) and its namespace, validated once.

Why ``array('q')``: 8 bytes a token instead of a ~40-byte int object, slices that compare as memory,
and engines that hold arrays (SGLang's scheduler does) hand them over in one memcpy.
"""

from __future__ import annotations

import logging
import operator
import os
import reprlib
from array import array
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger(__name__)


NATIVE_API_VERSION = 8  # the API_VERSION of tierkv/_radix.c that the tree calls


def load_native(name: str) -> Callable | None:
    """A function of the compiled tree core (tierkv/_radix.c), or None when it is not built, when
    ``TIERKV_PURE_PYTHON_TREE=1`` asks for the pure-Python reference, or when the build found is another
    version (say, left on the path by an editable install of another checkout: it may lack the function
    or refuse the keys the tree now holds)."""
    if os.environ.get("TIERKV_PURE_PYTHON_TREE") == "1":
        return None
    try:
        from tierkv import _radix
    except ImportError:
        return None
    version = getattr(_radix, "API_VERSION", 1)
    if version != NATIVE_API_VERSION:
        log.warning("ignoring %s: API version %s, expected %s (rebuild: python setup.py build_ext --inplace)",
                    getattr(_radix, "__file__", _radix), version, NATIVE_API_VERSION)
        return None
    return getattr(_radix, name)


native_pack_int64 = load_native("pack_int64")  # tests set it to None to run on the pure-Python path


@dataclass(frozen=True)
class RadixKey:
    """A request's token ids plus an optional namespace; different ``extra_key`` never share nodes.

    ``token_ids``: a list, tuple, range or ``array`` of ints, or a numpy array / torch tensor of an integer
    dtype, stored as an ``array('q')`` (8 bytes a token; slices compare as memory). An ``array('q')``
    (what SGLang's scheduler holds) is adopted as is, not copied, as SGLang's own RadixKey does: the
    caller hands it over and must not change it afterwards (the tree copies what it keeps). Every other
    form is converted into a new array. ``extra_key``: None or a str that encodes as UTF-8 (it is hashed
    into L3 keys). Anything else is a TypeError or ValueError naming the field and the value.
    """

    token_ids: Sequence[int]
    extra_key: str | None = None

    def __post_init__(self) -> None:
        ids = self.token_ids
        if type(ids) is not array or ids.typecode != "q":  # an array('q') is adopted: nothing to set
            object.__setattr__(self, "token_ids", _token_array(ids))
        if self.extra_key is not None:
            if not isinstance(self.extra_key, str):
                raise TypeError(f"extra_key must be a str or None, got {self.extra_key!r}")
            try:
                self.extra_key.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"extra_key {self.extra_key!r} is not encodable as UTF-8") from None

    def __hash__(self) -> int:
        return hash((self.token_ids.tobytes(), self.extra_key))

    def __len__(self) -> int:
        return len(self.token_ids)


def _token_array(ids: object) -> array:
    """``ids`` as an ``array('q')``; TypeError naming what is not a 64-bit int id."""
    if type(ids) is array and ids.typecode == "q":
        return ids  # handed over: a copy of a long prompt costs more than the whole match
    dtype = getattr(ids, "dtype", None)
    if dtype is not None and hasattr(ids, "tolist"):  # a numpy array or torch tensor
        name = str(dtype).removeprefix("torch.")
        if not name.startswith(("int", "uint")) or getattr(ids, "ndim", 1) != 1:
            raise TypeError(f"token_ids must be a 1-d integer array, got dtype {name} with "
                            f"{getattr(ids, 'ndim', '?')} dims")
        ids = ids.tolist()  # plain ints
    elif isinstance(ids, array):
        if ids.typecode in "fdu":
            raise TypeError(f"token_ids must be integers, got an array of typecode {ids.typecode!r}")
    elif isinstance(ids, Sequence) and not isinstance(ids, (str, bytes, bytearray)):
        packed = native_pack_int64(ids) if native_pack_int64 is not None and type(ids) in (list, tuple) else None
        if packed is not None:  # every item a plain int that fits: packed in one C loop
            out = array("q")
            out.frombytes(packed)
            return out
        if set(map(type, ids)) - {int}:  # bools, floats, numpy scalars...: one at a time
            ids = [_token_id(i, x) for i, x in enumerate(ids)]
    else:  # sets and dicts have no order; strings are not token ids
        raise TypeError(f"token_ids must be a sequence of ints (list, tuple, range, array, integer "
                        f"tensor), got {type(ids).__name__} {reprlib.repr(ids)}")
    try:
        return array("q", ids)
    except OverflowError as exc:
        raise TypeError(f"token ids must be 64-bit ints: {exc}") from None


def _token_id(index: int, value: object) -> int:
    """One id that is not a plain int: integer types are converted, bools and the rest refused."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        raise TypeError(f"token_ids[{index}] must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"token_ids[{index}] must be an int, got {value!r}") from None


# elements beyond its own that a node's key may keep alive: a view of a caller's array that leaves out at
# most KEY_SLACK (a partial last page) or an eighth of its own elements is kept as a view, else copied
# (copying a 100k-token prompt's new part to save the few hundred tokens before it cost more than its insert)
KEY_SLACK = 64


def key_slack(num_elements: int) -> int:
    """Elements beyond ``num_elements`` that a node's key may keep alive (see :data:`KEY_SLACK`)."""
    return max(KEY_SLACK, num_elements // 8)


def own_key(key: object) -> object:
    """``key`` (one half of a split node's key) as what the node may keep: a view of an array it leaves
    mostly unused becomes a copy, so the other half's tokens are not kept alive by it."""
    if type(key) is memoryview and len(key.obj) - len(key) > key_slack(len(key)):
        own = array("q")
        own.frombytes(key.cast("B"))
        return own
    return key
