"""Vocabulary-parallel embedding and LM head (rank r holds a contiguous vocab range)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscale.server.parallel import ParallelState


class VocabParallelEmbedding(nn.Module):
    """Token ids ``[T] int64`` -> embeddings ``[T, dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.world_size
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.per_rank = (num_embeddings + tp - 1) // tp
        self.vocab_start = parallel.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding shape {tuple(loaded.shape)} does not match "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mask, ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states ``[N, dim]`` -> logits ``[N, vocab]`` (gathered over ranks)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        logits = self.parallel.all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
