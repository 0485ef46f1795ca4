"""Tensor-parallel state: which rank this process is, of how many, and its collectives.

The layers receive a ``ParallelState`` when they are built and shard by its ``rank`` and
``world_size``; its collectives are no-ops for a single rank, so the same model code
runs unsharded. ``SINGLE`` is the one-rank state. The collectives are the ones the
model and the worker need: a sum (row-parallel layers, the vocabulary-parallel
embedding; fused with the residual add and RMSNorm after a row-parallel layer), a
gather along the last dimension (the LM head's logits), a broadcast from the driver
(the sampled tokens) and a minimum (the KV blocks every rank can hold). On CUDA they run
on NCCL, inside CUDA graphs too, except the sums that ``one_shot`` takes (a kernel
reading the peers' memory: ``server/distributed/one_shot.py``); on the CPU on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvscale.server.layers import ops

# torch 2.13 renamed all_gather_into_tensor (2.11 has only the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

VOCAB_PAD = 64  # each rank's share of a padded vocabulary is a multiple of this many rows


def padded_vocab_size(vocab_size: int, world_size: int) -> int:
    """The vocabulary rounded up so that it splits into ``world_size`` equal shares of a
    multiple of ``VOCAB_PAD`` rows (aligned GEMM tiles); unpadded for one rank."""
    if world_size == 1:
        return vocab_size
    multiple = VOCAB_PAD * world_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ParallelState:
    """``rank`` of ``world_size`` in ``group`` (a torch.distributed process group, or
    None for the default group; unused when ``world_size`` is 1)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    one_shot: Any = None  # a OneShotAllReduce for the sums it fits, or None: NCCL only

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
            if self._one_shot_fits(x):
                self.one_shot.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place, ``x [T, H]`` being this rank's share of a sum: ``residual <- sum(x) +
        residual``, ``x <- rms_norm(residual) * weight``. One kernel where ``one_shot``
        fits x, else the sum then ``fused_add_rms_norm``: the same bits either way."""
        if self.world_size > 1:
            if self._one_shot_fits(x):
                self.one_shot.all_reduce(x, residual, weight, eps)
                return
            dist.all_reduce(x, group=self.group)  # (fits is asked once a sum)
        ops.fused_add_rms_norm(x, residual, weight, eps)

    def _one_shot_fits(self, x: torch.Tensor) -> bool:
        # torch.compile traces NCCL's collective (a functional collective), not the kernel
        return (
            self.one_shot is not None
            and not torch.compiler.is_compiling()
            and self.one_shot.fits(x)
        )

    def all_gather_last_dim(self, x: torch.Tensor, valid: list[int] | None = None) -> torch.Tensor:
        """Concatenates each rank's shard of the last dimension, in rank order, keeping
        the first ``valid[r]`` columns of rank ``r``'s shard (None: all of them), into
        one contiguous tensor. One collective (``all_gather_into_tensor``, capturable in
        a CUDA graph) and one copy."""
        if self.world_size == 1:
            return x if valid is None else x[..., : valid[0]]
        x = x.contiguous()
        flat = torch.empty(
            (self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device
        )
        _all_gather_single(flat, x, group=self.group)
        out = flat.view(self.world_size, *x.shape)
        if valid is None:
            parts = list(out.unbind(0))
        else:
            parts = [out[r, ..., :n] for r, n in enumerate(valid) if n > 0]
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites ``x`` (contiguous) on every rank with rank ``src``'s; returns it."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

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
