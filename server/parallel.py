"""Tensor-parallel state: which rank this process is, of how many, and its collectives.

The layers receive a ``ParallelState`` when they are built and shard by its ``rank`` and
``world_size``; its collectives are no-ops for a single rank, so the same model code
runs unsharded. ``SINGLE`` is the one-rank state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """``rank`` of ``world_size`` in ``group`` (a torch.distributed process group, or
    None for the default group; unused when ``world_size`` is 1)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and talks to the API process."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the group, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates each rank's shard of the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (e.g. the KV blocks all ranks can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def shard(self, n: int, what: str) -> int:
        """``n / world_size``; ValueError naming ``what`` if it does not divide."""
        if n % self.world_size:
            raise ValueError(
                f"{what}={n} is not divisible by tensor_parallel_size={self.world_size}"
            )
        return n // self.world_size


SINGLE = ParallelState()
