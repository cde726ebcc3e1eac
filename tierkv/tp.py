"""Agreement across tensor-parallel ranks: one all-reduce per scheduler step, no-op for one rank.

Every rank holds a shard of the KV heads and runs the same tree. Background work (copies, storage I/O)
finishes at different times on different ranks, so whatever a tree update depends on is first agreed:
counts of finished operations by MIN (retire only what every rank has finished), "stop now" votes by
MAX (terminated anywhere means terminated everywhere). Both kinds travel in one int64 tensor: MAX
fields are negated, the tensor is reduced with MIN, and they are negated back (max(x) == -min(-x)).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from tierkv.radix import RadixTree, TreeNode


class TPGroup:
    """Agrees on per-step progress counts across ranks so every rank makes identical tree updates.

    ``collectives`` counts the collectives this group ran (it stays 0 for one rank: no collective ever
    runs then). ``group`` is a ``torch.distributed`` process group (None: the default group).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None,
                 device: torch.device | str | None = None) -> None:
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) \
                or not 0 <= rank < world_size:
            raise ValueError(f"bad TP rank {rank!r} of world_size {world_size!r}")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.collectives = 0

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    @classmethod
    def from_group(cls, group: Any = None) -> "TPGroup":
        """A group over an initialised ``torch.distributed`` process group (None: the default one).

        NCCL reduces device tensors only, so its agreement tensor lives on the current CUDA device;
        gloo (CPU, or GPU hosts choosing it for small control messages) reduces CPU tensors.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call init_process_group first")
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(dist.get_rank(group), dist.get_world_size(group), group, device)

    @classmethod
    def from_default_group(cls) -> "TPGroup":
        """A group spanning the default process group; one rank when torch.distributed is not set up."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return cls.single()
        return cls.from_group(None)

    def agree(self, min_values: Sequence[int], max_values: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """Element-wise MIN of ``min_values`` and MAX of ``max_values`` over ranks, in one collective.

        Identity for one rank. Every rank must pass the same number of fields of each kind.
        """
        if self.world_size == 1:
            return list(min_values), list(max_values)
        import torch.distributed as dist

        num_min = len(min_values)
        fields = list(min_values) + [-v for v in max_values]
        tensor = torch.tensor(fields, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        agreed = tensor.tolist()
        return agreed[:num_min], [-v for v in agreed[num_min:]]

    def all_reduce_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over ranks, in one collective; identity for one rank."""
        return self.agree(values)[0]

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        """Element-wise maximum over ranks, in one collective; identity for one rank."""
        return self.agree((), values)[1]

    def gather_digests(self, digest: str) -> list[str]:
        """Every rank's ``digest`` in rank order (for error messages; one collective)."""
        if self.world_size == 1:
            return [digest]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, digest, group=self.group)
        self.collectives += 1
        return out

    def check_same_tree(self, tree: RadixTree, include_slots: bool = False) -> str:
        """Raise AssertionError naming the ranks whose tree differs from rank 0's; returns the digest.

        One small all-reduce when the trees agree: the digest's MIN and MAX over ranks are equal.
        """
        digest = tree_digest(tree, include_slots)
        words = _digest_words(digest)
        low, high = self.agree(words, words)
        if low != high:
            digests = self.gather_digests(digest)
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            raise AssertionError(f"TP ranks {differ} diverged from rank 0 (digests {digests})")
        return digest


def _digest_words(digest: str) -> list[int]:
    """A hex digest as non-negative int64 words (7 bytes each, so negating a MAX field cannot overflow)."""
    raw = bytes.fromhex(digest)
    return [int.from_bytes(raw[i:i + 7], "little") for i in range(0, len(raw), 7)]


def _node_record(node: TreeNode, include_slots: bool) -> tuple:
    num_hashes = None if node.hash_values is None else len(node.hash_values)
    key = node.key  # an array('q') or a memoryview of one (whose repr is an address), pairs in bigram mode
    record = (repr(key) if isinstance(key, list) else key.tobytes(), node.extra_key, node.device_value is not None, node.host_value is not None,
              num_hashes, node.lock_ref, node.host_ref, node.hit_count, node.last_access_time,
              node.creation_time, node.priority)
    if include_slots:
        record += tuple(None if v is None else v.tolist() for v in (node.device_value, node.host_value))
    return record


def tree_digest(tree: RadixTree, include_slots: bool = False) -> str:
    """A stable hash of what every TP rank's tree must agree on.

    Covers structure, keys and namespaces, which tiers hold each node, whether it has page hashes, lock
    and host refs, hit counts, logical access/creation ticks, priorities and the size accounting. Left
    out: node ids and (by default) slot numbers, process-local names rather than decisions, and the page
    hash values themselves, which differ by design (each rank's namespace names its TP shard).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tree.page_size, tree.bigram, tree._tick, tree.evictable_size,
                   tree.protected_size)).encode())
    stack: list[tuple[int, TreeNode]] = [(0, tree.root)]
    while stack:
        depth, node = stack.pop()
        if node is not tree.root:
            h.update(repr((depth, _node_record(node, include_slots))).encode())
        children = sorted(node.children.items(), key=lambda kv: repr(kv[0]), reverse=True)
        stack.extend((depth + 1, child) for _, child in children)
    return h.hexdigest()
