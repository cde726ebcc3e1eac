"""Agreement across tensor-parallel ranks: one all-reduce per scheduler step, no-op for one rank."""

from __future__ import annotations

import torch


class TPGroup:
    """Agrees on per-step progress counts across ranks so every rank makes identical tree updates."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: object = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad TP rank {rank!r} of world_size {world_size!r}")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.collectives = 0

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over ranks, in one collective; identity for one rank."""
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        return tensor.tolist()
