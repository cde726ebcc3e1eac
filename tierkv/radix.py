"""Radix tree over token-id keys: structure only.

Values stored on nodes (device slots, host slots, page hashes) are opaque to the tree: it only needs
``len()`` and slicing of them, so it never imports torch or knows about tiers.

Node keys are ``array('q')`` token ids, or read-only-by-contract ``memoryview``s of the caller's key
array (format ``q``, see :meth:`RadixTree._leaf_key`): both have ``len``, indexing, slicing, ``tobytes``
and the buffer protocol; lists of token pairs in bigram mode.

Invariants kept by the tree (checked by :meth:`RadixTree.check_integrity`):
- every non-root node has a non-empty key whose length is a multiple of ``page_size``;
- a node with a value has ``len(value) == len(key)``;
- children are keyed by :func:`RadixTree.child_key` of their key;
- ``evictable_size + protected_size`` equals the device tokens held by the tree, split by lock state;
- nodes holding device values form a subtree at the root; a node holding host values has a parent (or the
  root) holding device or host values, so every node's path is loadable.
"""

from __future__ import annotations

import itertools
from array import array
from typing import Any, Callable, Hashable, Iterable, Iterator

from tierkv import radix_walk
from tierkv.radix_frontiers import Frontiers
from tierkv.radix_key import KEY_SLACK, RadixKey, key_slack, load_native, own_key
from tierkv.radix_records import InsertPlan, InsertResult, MatchPath
from tierkv.radix_walk import Walk, walk_python

_node_ids = itertools.count(1)
_INVALID, _IN_STORAGE = 1, 2  # TreeNode._flags bits


def _flag_property(bit: int, doc: str) -> property:
    """A boolean attribute stored as one bit of ``TreeNode._flags``."""
    def get(node: "TreeNode") -> bool:
        return bool(node._flags & bit)

    def set_(node: "TreeNode", value: bool) -> None:
        node._flags = node._flags | bit if value else node._flags & ~bit
    return property(get, set_, doc=doc)


class TreeNode:
    """One edge of the tree. ``last_access_time`` is a logical clock tick, identical across TP ranks.

    ``device_value`` and ``host_value`` are properties so that any assignment, wherever it happens,
    keeps the tree's eviction frontiers right.
    """

    __slots__ = (
        "id", "key", "extra_key", "parent", "children", "_device_value", "_host_value", "hash_values",
        "lock_ref", "host_ref", "hit_count", "last_access_time", "creation_time", "priority", "_frontiers",
        "_flags",
    )

    def __init__(self, key: list, extra_key: str | None, parent: "TreeNode | None", tick: int) -> None:
        self.id = next(_node_ids)
        self.key = key
        self.extra_key = extra_key
        self.parent = parent
        self._frontiers = parent._frontiers if parent is not None else Frontiers()
        self.children: dict[Hashable, TreeNode] = {}
        self._device_value: Any = None
        self._host_value: Any = None
        self.hash_values: list | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access_time = tick
        self.creation_time = tick
        self.priority = 0
        # two booleans in one slot: a slot per flag made a node 8 bytes larger (fan-out trees have a node
        # every few tokens, so the memory per cached token went above SGLang's)
        self._flags = 0

    invalid = _flag_property(_INVALID, "device_value is garbage (a failed load): never matched, dropped when unlocked")
    in_storage = _flag_property(
        _IN_STORAGE, "A backup of this node's pages to the storage tier (L3) was started or judged not worth "
        "writing: exclusive tiers, which keep no L2 copy of what L1 holds, need not copy it to L2 for L3 again")

    @property
    def device_value(self) -> Any:
        return self._device_value

    @device_value.setter
    def device_value(self, value: Any) -> None:
        self._device_value = value
        self._frontiers.value_changed(self, value is not None, device=True)

    @property
    def host_value(self) -> Any:
        return self._host_value

    @host_value.setter
    def host_value(self, value: Any) -> None:
        self._host_value = value
        self._frontiers.value_changed(self, value is not None, device=False)

    @property
    def evicted(self) -> bool:
        return self.device_value is None

    @property
    def backed_up(self) -> bool:
        return self.host_value is not None

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, device={self.device_value is not None}, "
                f"host={self.host_value is not None}, lock={self.lock_ref}, host_ref={self.host_ref})")


# the compiled walk and key comparison, read when a tree is built (tests set them to None)
native_common_prefix_len = radix_walk.native_common_prefix_len
native_walk = radix_walk.native_walk
native_new_leaf = load_native("new_leaf")
_common_prefix_len = radix_walk.common_prefix_len
_new_walk = tuple.__new__  # a Walk from the walk's 4-tuple: what Walk._make does, without its Python frame


def implementation() -> str:
    """Which key comparison new trees use: "c" or "python"."""
    return "python" if native_common_prefix_len is None else "c"


class RadixTree:
    """Prefix tree over page-aligned token keys. Not thread-safe: callers serialise access."""

    def __init__(self, page_size: int = 1, bigram: bool = False,
                 slice_value: Callable[[Any, int, int], Any] | None = None) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.bigram = bigram
        # keys are int64 arrays except in bigram mode (lists of pairs): those compare in Python
        native = native_common_prefix_len
        self._prefix_len = native if native is not None and not bigram else _common_prefix_len
        self._native_walk = native_walk if native is not None and not bigram else None
        self._native_leaf = native_new_leaf if native is not None and not bigram else None
        self._tick = 0
        self.root = TreeNode([], None, None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0
        # called as split_hook(top, bottom) after every split, so per-node state kept outside the tree (an
        # eviction policy's, by node id) follows the new top node: it holds the same tokens' KV, same uses
        self.split_hook: Callable[[TreeNode, TreeNode], None] | None = None
        # slice_value(value, start, end): the part of a caller's value a node keeps. Plain slicing by
        # default; a cache whose values are views (slot tensors) passes one that copies a small part of a
        # large buffer, so that a node never keeps a caller's whole tensor alive
        self._slice_value = slice_value or _plain_slice

    # ---- keys ---------------------------------------------------------------------------------------
    def elements(self, key: RadixKey) -> list:
        """Key elements the tree stores: tokens, or token pairs in bigram mode, cut to whole pages.

        The ids were checked when the key was built; the result is remembered on ``key`` (a scheduler
        matches, then inserts, the same key). Callers must not mutate it.
        """
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        shape = (self.page_size, self.bigram, len(key.token_ids))
        memo = key.__dict__.get("_elements")
        if memo is not None and memo[0] == shape:
            return memo[1]
        ids = key.token_ids
        elems: Any = list(zip(ids, ids[1:])) if self.bigram else ids
        cut = len(elems) - len(elems) % self.page_size
        elems = elems if cut == len(elems) else elems[:cut]
        object.__setattr__(key, "_elements", (shape, elems))
        return elems

    def num_elements(self, key: RadixKey) -> int:
        """``len(self.elements(key))`` without building the elements."""
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        n = len(key.token_ids)
        n = max(0, n - 1) if self.bigram else n
        return n - n % self.page_size

    def _walk_elements(self, key: RadixKey) -> tuple[Any, int]:
        """Elements to walk and how many of them count (whole pages). Outside bigram mode: the key's
        own token array, uncut (a cut copies the whole prompt); a match never reaches past the count,
        since it ends on a page boundary and the uncounted tail is shorter than a page."""
        if self.bigram or not isinstance(key, RadixKey):
            elems = self.elements(key)
            return elems, len(elems)
        ids = key.token_ids
        return ids, len(ids) - len(ids) % self.page_size

    def child_key(self, elems: Any, extra_key: str | None, offset: int = 0) -> Hashable:
        """The children-dict key of the edge starting at ``elems[offset]``: its first element, or its
        first page (as bytes: one copy, hashed as memory; as a tuple of pairs in bigram mode)."""
        if self.page_size == 1:
            first = elems[offset]
        elif self.bigram:
            first = tuple(elems[offset: offset + self.page_size])
        else:
            first = elems[offset: offset + self.page_size].tobytes()
        return first if extra_key is None else (extra_key, first)

    def _touch(self) -> int:
        self._tick += 1
        return self._tick

    # ---- match / insert -----------------------------------------------------------------------------
    def _walk(self, elems: Any, num_elems: int, extra_key: str | None) -> tuple:
        """The fields of a :class:`~tierkv.radix_walk.Walk` of ``elems[:num_elems]``, as a tuple."""
        if self._native_walk is not None:
            return self._native_walk(self.root, elems, num_elems, self.page_size, extra_key)
        return walk_python(self.root, elems, num_elems, self.page_size, extra_key, self.child_key, self._prefix_len)

    def match(self, key: RadixKey, touch: bool = True) -> MatchPath:
        """Walk the longest page-aligned prefix of ``key``, splitting a node at a partial match.

        Lock contract: takes no lock; splitting preserves the lock and host_ref counts of the node split.
        """
        elems, num_elems = self._walk_elements(key)
        path, num_matched, partial, partial_len = self._walk(elems, num_elems, key.extra_key)
        if partial is not None:
            path.append(self._split(partial, partial_len))
        if touch:  # touched: an eviction heap re-ranks them
            tick = self._touch()
            for node in path:
                node.last_access_time = tick
            self.root._frontiers.touched_path(path)
        return MatchPath(path, num_matched + partial_len)

    def plan_insert(self, key: RadixKey, num_values: int) -> InsertPlan:
        """Where ``key`` meets the tree, for :meth:`apply_insert`; changes nothing. Raises ValueError when
        ``num_values`` (the value's length) is shorter than the key's elements.

        Lock contract: takes no lock. The plan is void once the tree changes: apply it before anything else.
        """
        if self.bigram or type(key) is not RadixKey:
            elems, num_elems = self._walk_elements(key)
        else:  # _walk_elements, inline: once per insert
            elems = key.token_ids
            num_elems = len(elems) - len(elems) % self.page_size
        if num_values < num_elems:
            raise ValueError(f"value of length {num_values} is shorter than the key's {num_elems} elements")
        return InsertPlan(key, elems, num_elems, _new_walk(Walk, self._walk(elems, num_elems, key.extra_key)))

    def insert(self, key: RadixKey, value: Any, priority: int = 0) -> InsertResult:
        """Insert ``key`` with device ``value`` (len(value) >= len(elements)); see :class:`InsertResult`.

        Lock contract: takes no lock; nodes revived or created are unlocked (counted evictable).
        """
        return self.apply_insert(self.plan_insert(key, len(value)), value, priority)

    def apply_insert(self, plan: InsertPlan, value: Any, priority: int = 0, leaf_value: Any = None) -> InsertResult:
        """Carry out ``plan`` (from :meth:`plan_insert`, the tree unchanged since) with device ``value``:
        split the node matched in part, give valueless nodes on the path their part of ``value``, add the
        rest as a new leaf (``leaf_value``, when the caller cut it already). Lock contract: takes no lock;
        nodes revived or created are unlocked."""
        walk, num_elems = plan.walk, plan.num_elems
        path = walk.nodes
        if walk.partial is not None:
            path.append(self._split(walk.partial, walk.partial_len))
        self._tick += 1
        tick = self._tick
        result = InsertResult(walk.num_matched + walk.partial_len, path, [])
        pos = 0
        for child in path:
            child.last_access_time = tick
            if priority > child.priority:
                child.priority = priority
            if child._device_value is None:
                end = pos + len(child.key)
                self._attach(child, self._slice_value(value, pos, end))
                result.revived.append(child)
            pos += len(child.key)
        frontiers = self.root._frontiers
        if pos >= num_elems:
            frontiers.touched_path(path)  # re-ranked by eviction heaps
            return result
        extra_key = plan.key.extra_key
        node = path[-1] if path else self.root
        if leaf_value is None:
            whole = not pos and self._slice_value is _plain_slice and len(value) == num_elems  # no slice needed
            leaf_value = value if whole else self._slice_value(value, pos, num_elems)
        elems = plan.elems
        if self._native_leaf is not None and type(elems) is array:
            leaf = self._native_leaf(TreeNode, _node_ids, node, elems, pos, num_elems, extra_key, tick, priority,
                                     leaf_value, self.page_size, KEY_SLACK)
        else:  # what the compiled new_leaf does
            leaf = TreeNode(self._leaf_key(elems, pos, num_elems), extra_key, node, tick)
            leaf.priority = priority
            leaf._device_value = leaf_value
            node.children[self.child_key(leaf.key, extra_key)] = leaf
        self.evictable_size += num_elems - pos  # a new leaf is unlocked
        result.new_node = leaf
        path.append(leaf)
        frontiers.leaf_added(path)  # its value, and the path touched: re-ranked by eviction heaps
        return result

    def _leaf_key(self, elems: Any, start: int, end: int) -> Any:
        """A new leaf's key ``elems[start:end]``: a view of the caller's token array when it is all of it
        but at most :func:`~tierkv.radix_key.key_slack` elements (a partial page, or an eighth), else a
        copy. The array is the caller's to hand over (see RadixKey): a view of a whole prompt saves copying
        it, and a view of a part would keep the rest alive (a short branch pinned a long shared prompt)."""
        if type(elems) is array and len(elems) - (end - start) <= key_slack(end - start):
            return memoryview(elems)[start:end]
        return elems[start:end]

    def add_leaf(self, parent: TreeNode, elems: list, extra_key: str | None) -> TreeNode:
        """A new valueless leaf under ``parent`` for the caller to give a value (an L3 prefetch's host slots).

        Lock contract: takes no lock; the leaf starts unlocked and unprotected.
        """
        if not elems or len(elems) % self.page_size:
            raise ValueError(f"leaf key of {len(elems)} elements is not whole pages of {self.page_size}")
        elems = list(elems) if self.bigram else array("q", elems)
        child_key = self.child_key(elems, extra_key)
        if child_key in parent.children:
            raise ValueError(f"node {parent.id} already has a child starting with {child_key!r}")
        leaf = TreeNode(elems, extra_key, parent, self._touch())
        parent.children[child_key] = leaf
        return leaf

    def touch(self, nodes: list[TreeNode]) -> None:
        """Refresh ``nodes``' recency with one new tick, as a match would, without touching their
        ancestors (an L3 prefetch's insert walk). Lock contract: takes no lock."""
        tick = self._touch()
        for node in nodes:
            node.last_access_time = tick
        self.root._frontiers.touched(nodes)  # re-ranked by eviction heaps

    def split(self, node: TreeNode, num_elements: int) -> TreeNode:
        """Split ``node`` so its first ``num_elements`` (whole pages) become a new parent; returns that parent.

        An eviction that needs only part of a node's tokens splits off its tail and evicts that.
        Lock contract: takes no lock; both halves keep the node's lock and host_ref counts.
        """
        if node is self.root or node.parent is None:
            raise ValueError("the root cannot be split")
        if not isinstance(num_elements, int) or not 0 < num_elements < len(node.key):
            raise ValueError(f"num_elements must be in 1..{len(node.key) - 1} to split node {node.id}, "
                             f"got {num_elements!r}")
        if num_elements % self.page_size:
            raise ValueError(f"num_elements {num_elements} is not a multiple of page_size {self.page_size}")
        return self._split(node, num_elements)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` so its first ``n`` elements become a new parent; returns that parent."""
        top = TreeNode(None, child.extra_key, child.parent, child.creation_time)
        top.last_access_time = child.last_access_time
        top.hit_count, top.priority = child.hit_count, child.priority
        top.lock_ref, top.host_ref = child.lock_ref, child.host_ref
        top._flags = child._flags
        cut = self._slice_value
        if child.device_value is not None:
            value = child.device_value
            top.device_value = cut(value, 0, n)
            child.device_value = cut(value, n, len(value))
        if child.host_value is not None:
            value = child.host_value
            top.host_value = cut(value, 0, n)
            child.host_value = cut(value, n, len(value))
        if child.hash_values is not None:
            pages = n // self.page_size
            top.hash_values, child.hash_values = child.hash_values[:pages], child.hash_values[pages:]
        child.parent.children[self.child_key(child.key, child.extra_key)] = top
        top.key, child.key = own_key(child.key[:n]), own_key(child.key[n:])
        child.parent = top
        top.children[self.child_key(child.key, child.extra_key)] = child
        if self.split_hook is not None:
            self.split_hook(top, child)
        return top

    # ---- values and accounting ----------------------------------------------------------------------
    def set_device_value(self, node: TreeNode, value: Any) -> None:
        """Attach device slots to ``node``. Lock contract: accounts by the node's current lock_ref."""
        if node.device_value is not None:
            raise ValueError(f"node {node.id} already has a device value")
        if len(value) != len(node.key):
            raise ValueError(f"value length {len(value)} != key length {len(node.key)}")
        node.device_value = value
        self._account(node, len(value))

    def _attach(self, node: TreeNode, value: Any) -> None:
        """:meth:`set_device_value` for callers that know the node has none and the lengths agree."""
        node.device_value = value
        if node.lock_ref > 0:
            self.protected_size += len(node.key)
        else:
            self.evictable_size += len(node.key)

    def clear_device_value(self, node: TreeNode) -> Any:
        """Detach and return the device slots. Lock contract: node must be unlocked."""
        if node.lock_ref > 0:
            raise RuntimeError(f"cannot drop the device value of locked node {node.id}")
        value, node.device_value = node.device_value, None
        if value is not None:
            self._account(node, -len(node.key))
        return value

    def _account(self, node: TreeNode, delta: int) -> None:
        if node.lock_ref > 0:
            self.protected_size += delta
        else:
            self.evictable_size += delta

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock contract: +1 lock_ref on ``node`` and every ancestor; device tokens become protected."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0 and node.device_value is not None:
                self.evictable_size -= len(node.key)  # == len(device_value), and cheaper
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Lock contract: -1 lock_ref on ``node`` and every ancestor; raises if any is not locked."""
        while node is not self.root and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked node {node.id}")
            if node.lock_ref == 1:  # unlocked: a candidate again for eviction heaps
                if node.device_value is not None:
                    self.protected_size -= len(node.key)
                    self.evictable_size += len(node.key)
                node._frontiers.touched((node,))
            node.lock_ref -= 1
            node = node.parent

    def inc_host_ref(self, node: TreeNode) -> None:
        """Lock contract: +1 host_ref on ``node`` and every ancestor; their host slots stay in L2."""
        while node is not self.root and node is not None:
            node.host_ref += 1
            node = node.parent

    def dec_host_ref(self, node: TreeNode) -> None:
        """Lock contract: -1 host_ref on ``node`` and every ancestor; raises if any is not protected."""
        while node is not self.root and node is not None:
            if node.host_ref <= 0:
                raise RuntimeError(f"dec_host_ref on unprotected node {node.id}")
            if node.host_ref == 1 and node._frontiers.host_changed is not None:
                node._frontiers.host_changed.add(node)
            node.host_ref -= 1
            node = node.parent

    def remove_leaf(self, node: TreeNode) -> None:
        """Unlink a childless node with no values left. Lock contract: node must be unlocked."""
        if node.children or node._device_value is not None or node._host_value is not None:
            raise RuntimeError(f"node {node.id} is not an empty leaf")
        if node.lock_ref or node.host_ref:
            raise RuntimeError(f"node {node.id} is locked")
        del node.parent.children[self.child_key(node.key, node.extra_key)]
        frontiers = node._frontiers
        for nodes in (frontiers.device, frontiers.host, frontiers.device_changed, frontiers.host_changed):
            if nodes is not None:
                nodes.discard(node)

    # ---- traversal ----------------------------------------------------------------------------------
    def nodes(self) -> Iterator[TreeNode]:
        """All nodes but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_leaves(self) -> list[TreeNode]:
        """Unlocked nodes with device slots and no child holding device slots: the L1 eviction frontier."""
        frontier = self._tracked("device")
        frontier.difference_update([n for n in frontier if not _is_device_leaf_node(n)])
        return [n for n in frontier if n.lock_ref == 0]

    def host_leaves(self) -> list[TreeNode]:
        """Nodes with host slots, no host_ref, and no child holding host slots: the L2 eviction frontier."""
        frontier = self._tracked("host")
        frontier.difference_update([n for n in frontier if not _is_host_leaf_node(n)])
        # what is_host_leaf adds for a node already known to be a host leaf (one pass: this runs on
        # every L2 eviction over the whole frontier)
        return [n for n in frontier if n.host_ref == 0 and (n._device_value is not None or n.lock_ref == 0)]

    # the two checks below run once or twice per node an eviction heap ranks or pops: plain loops over
    # the slots, no generator, no property
    def is_host_leaf(self, n: TreeNode) -> bool:
        """True when L2 may drop ``n``'s host slots now (a locked host-only node is kept)."""
        if (n._host_value is None or n.host_ref or n is self.root
                or (n._device_value is None and n.lock_ref)):
            return False
        for c in n.children.values():
            if c._host_value is not None:
                return False
        return True

    def is_device_leaf(self, n: TreeNode) -> bool:
        """True when L1 may evict ``n`` now."""
        if n._device_value is None or n.lock_ref or n is self.root:
            return False
        for c in n.children.values():
            if c._device_value is not None:
                return False
        return True

    def total_tokens(self, tier: Callable[[TreeNode], Any]) -> int:
        return sum(len(v) for v in map(tier, self.nodes()) if v is not None)

    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the root's child down to ``node``."""
        path = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def reset(self) -> None:
        self.root.children.clear()
        self.root._frontiers = Frontiers()  # a new object: eviction heaps see the reset and start over
        self.evictable_size = self.protected_size = 0

    def changed_nodes(self, tier: str) -> set[TreeNode]:
        """Nodes whose eviction candidacy or rank in ``tier`` ("device" or "host") may have changed since
        the set was last cleared; its one consumer (an eviction heap) clears it. The first call starts the
        tracking (see :class:`~tierkv.radix_frontiers.Frontiers`): an eviction heap asks when it is made."""
        return self._tracked(f"{tier}_changed")

    def mark_changed(self, tier: str, nodes: Iterable[TreeNode]) -> None:
        """Have ``tier``'s eviction heap rank ``nodes`` again at its next call: for a caller that was
        handed victims and kept them. Lock contract: takes no lock."""
        changed = self._tracked(f"{tier}_changed")
        changed.update(nodes)

    def _tracked(self, name: str) -> set[TreeNode]:
        """The set ``name`` of the tree's :class:`~tierkv.radix_frontiers.Frontiers`, tracked from now on."""
        return self.root._frontiers.tracked(name, self.nodes)

    # ---- integrity ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError with the first broken invariant (structure, values, accounting, locks)."""
        evictable = protected = 0
        frontiers = self.root._frontiers
        for node in self.nodes():
            _check(node._frontiers is frontiers, node, "belongs to another tree's frontiers")
            if frontiers.device is not None and _is_leaf(node, "_device_value"):
                _check(node in frontiers.device, node, "device leaf missing from the eviction frontier")
            if frontiers.host is not None and _is_leaf(node, "_host_value"):
                _check(node in frontiers.host, node, "host leaf missing from the eviction frontier")
            _check(len(node.key) > 0 and len(node.key) % self.page_size == 0, node, "key not page-aligned")
            _check(node.parent.children.get(self.child_key(node.key, node.extra_key)) is node, node,
                   "not registered under its child key")
            _check(node.extra_key == node.parent.extra_key or node.parent is self.root, node,
                   "extra_key differs from parent")
            _check(node.device_value is not None or node.host_value is not None, node, "holds no value")
            for name in ("device_value", "host_value"):
                v = getattr(node, name)
                _check(v is None or len(v) == len(node.key), node, f"{name} length != key length")
            if node.hash_values is not None:
                _check(len(node.hash_values) == len(node.key) // self.page_size, node, "hash count")
            if node.device_value is not None and node.parent is not self.root:
                _check(node.parent.device_value is not None, node, "device child of evicted parent")
            if node.host_value is not None and node.parent is not self.root:  # loadable: the path to the
                # root holds KV in L1 or L2 all the way (L2 need not be a rooted subtree: write-back
                # copies only the evicted node)
                _check(node.parent.host_value is not None or node.parent.device_value is not None, node,
                       "host child of a parent in neither tier")
            _check(node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node,
                   "lock_ref below the sum of its children's")
            _check(node.host_ref >= sum(c.host_ref for c in node.children.values()), node,
                   "host_ref below the sum of its children's")
            _check(node.lock_ref >= 0 and node.host_ref >= 0, node, "negative ref count")
            if node.device_value is not None:
                if node.lock_ref > 0:
                    protected += len(node.device_value)
                else:
                    evictable += len(node.device_value)
        _check(evictable == self.evictable_size, self.root,
               f"evictable_size {self.evictable_size} != {evictable}")
        _check(protected == self.protected_size, self.root,
               f"protected_size {self.protected_size} != {protected}")


def _plain_slice(value: Any, start: int, end: int) -> Any:
    return value[start:end]


def _is_leaf(node: TreeNode, attr: str) -> bool:
    """True when ``node`` (not the root) holds a value in the tier ``attr`` and no child of it does."""
    return (node.parent is not None and getattr(node, attr) is not None
            and not any(getattr(c, attr) is not None for c in node.children.values()))


def _is_device_leaf_node(node: TreeNode) -> bool:
    """:func:`_is_leaf` for the device tier, spelled out: it runs over whole frontiers per eviction."""
    if node.parent is None or node._device_value is None:
        return False
    for c in node.children.values():
        if c._device_value is not None:
            return False
    return True


def _is_host_leaf_node(node: TreeNode) -> bool:
    """:func:`_is_leaf` for the host tier, spelled out: it runs over whole frontiers per eviction."""
    if node.parent is None or node._host_value is None:
        return False
    for c in node.children.values():
        if c._host_value is not None:
            return False
    return True


def _check(ok: bool, node: TreeNode, what: str) -> None:
    if not ok:
        raise AssertionError(f"radix integrity: {what} at {node!r}")
