"""The walk down a key that :meth:`RadixTree.match` and :meth:`RadixTree.plan_insert` share: which nodes a key
matches, changing nothing. The compiled walk (``walk`` of tierkv/_radix.c) does the same for int64 keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tierkv.radix_key import load_native

_SCAN_CHUNK = 256


def common_prefix_len(a: Any, b: Any, offset: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[offset:]``, by C-speed slice compares.

    Only ``len(a)`` elements of ``b`` are copied (``b`` is a whole prompt, ``a`` one edge). On a mismatch,
    fixed chunks locate it and a binary search finishes inside one chunk: a binary search over the
    whole edge would copy O(n log n) elements, which dominated matching long prompts.
    """
    n = min(len(a), len(b) - offset)
    if (a if n == len(a) else a[:n]) == b[offset:offset + n]:
        return n
    lo = 0  # a[:lo] equal
    while lo + _SCAN_CHUNK <= n and a[lo:lo + _SCAN_CHUNK] == b[offset + lo:offset + lo + _SCAN_CHUNK]:
        lo += _SCAN_CHUNK
    hi = min(n, lo + _SCAN_CHUNK) - 1  # a[:hi+1] not equal
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[offset + lo:offset + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# read when a tree is built; tests set them to None to run the same suite on the pure-Python reference
native_common_prefix_len = load_native("common_prefix_len")
native_walk = load_native("walk")


class Walk(NamedTuple):  # a tuple: made from the walk's tuple in one C call, one per insert
    """Where a key meets the tree: ``nodes`` matched whole (root side first) covering ``num_matched``
    elements, then ``partial`` matched in its first ``partial_len`` elements (whole pages), or None."""

    nodes: list
    num_matched: int
    partial: Any = None
    partial_len: int = 0

    @property
    def end(self) -> int:
        """Elements matched in all, the partial node's included."""
        return self.num_matched + self.partial_len


def walk_python(root: Any, elems: Any, num_elems: int, page_size: int, extra_key: str | None,
                child_key: Callable[[Any, str | None, int], Any], prefix_len: Callable[[Any, Any, int], int]) -> tuple:
    """The reference walk (bigram keys, or no compiled core): the fields of a :class:`Walk`, as a tuple."""
    node, pos, nodes = root, 0, []
    while pos < num_elems:
        child = node.children.get(child_key(elems, extra_key, pos))
        if child is None:
            break
        n = prefix_len(child.key, elems, pos)
        n -= n % page_size
        if n == 0:
            break
        if n < len(child.key):
            return nodes, pos, child, n
        nodes.append(child)
        node, pos = child, pos + n
    return nodes, pos, None, 0
