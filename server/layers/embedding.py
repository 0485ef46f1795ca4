"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded (``padded_vocab_size``: to equal shares of a multiple of 64 rows
per rank, unpadded for one rank) and rank r holds the contiguous rows
``[r * per_rank, (r + 1) * per_rank)``; rows past the real vocabulary are zeros. The
embedding looks up the ids of its range and sums over ranks; the LM head computes its
range's logits and gathers them, dropping the padding, so padded ids are never sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscale.kernels.tile_mm import TileConfig, tile_mm
from kvscale.server.layers import ops
from kvscale.server.parallel import ParallelState, padded_vocab_size

# Heads of up to this many rows run kernels/tile_mm's tiles on CUDA: at the 8B head
# (128,256 x 4,096 bf16) on an H100 they took 335 against cuBLAS's 365 us at one row,
# 343 / 367 at 16 and 354-360 / 369-378 at 32-64 rows; at 128 cuBLAS is ahead (r101,
# r102, bench/tile_mm_bench.py; NOTES e95, e97).
HEAD_TILE_MAX_ROWS = 64
HEAD_TILES_FEW = TileConfig(16, 64, 256, num_warps=4, num_stages=4)  # up to 16 rows
HEAD_TILES = TileConfig(64, 64, 128, num_warps=4, num_stages=4)


def head_tiles(h: torch.Tensor, weight: torch.Tensor) -> TileConfig | None:
    """The tiles for the head's product of ``h [N, dim]`` and ``weight``, or None for
    torch's: 16-bit operands where ``ops.few_rows_on_kernels`` at ``HEAD_TILE_MAX_ROWS``."""
    same_16_bit = h.dtype == weight.dtype and h.dtype in (torch.bfloat16, torch.float16)
    if not (same_16_bit and ops.few_rows_on_kernels(h, HEAD_TILE_MAX_ROWS)):
        return None
    return HEAD_TILES_FEW if h.shape[0] <= 16 else HEAD_TILES


class VocabParallelEmbedding(nn.Module):
    """Token ids ``[T] int64`` -> embeddings ``[T, dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.world_size
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.per_rank = padded_vocab_size(num_embeddings, tp) // tp
        self.vocab_start = min(parallel.rank * self.per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        # real (unpadded) rows each rank holds, in rank order
        self.valid_per_rank = [
            max(0, min(self.per_rank, num_embeddings - r * self.per_rank)) for r in range(tp)
        ]
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copies rows ``[vocab_start, vocab_end)`` of the checkpoint's ``[vocab, dim]``
        (only those are read from the file); the padding rows are zeroed."""
        if tuple(loaded.shape) != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"embedding shape {tuple(loaded.shape)} does not match "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))
        param.data[n:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mask, ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states ``[N, dim]`` -> logits ``[N, vocab]`` (gathered over ranks, padding
    dropped)."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [N, dim]`` -> logits ``[N, vocab]`` (the weight's dtype), written into
        ``out`` (``[N, vocab]``, contiguous) where given: a CUDA graph's static buffer,
        which graphs of several sizes share (their logits are the step's largest buffer:
        1,024 rows x 128,256 tokens in bf16 are 263 MB)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        tiles = head_tiles(h, self.weight)
        if out is not None and self.parallel.world_size == 1:  # no padding: the GEMM writes
            if tiles is not None:
                return tile_mm(h, self.weight, config=tiles, out=out)
            return torch.mm(h, self.weight.t(), out=out)
        if tiles is not None:
            logits = tile_mm(h, self.weight, config=tiles).reshape(*hidden.shape[:-1], -1)
        else:
            logits = F.linear(hidden, self.weight)
        if self.parallel.world_size == 1:
            logits = logits[..., : self.num_embeddings]
        else:
            logits = self.parallel.all_gather_last_dim(logits, self.valid_per_rank)
        return logits if out is None else out.copy_(logits)
