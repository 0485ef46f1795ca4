"""What attention needs to know about one engine step's batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """A step's batch: T new tokens from B sequences, flattened in sequence order.

    ``slot_mapping [T] int64``: cache slot (``block * block_size + offset``) of each new
    token; negative = padding, not written. ``query_start_loc [B+1] int32``: cumulative
    new-token offsets. ``seq_lens [B] int32``: tokens of each sequence in the cache after
    this step (earlier context + new). ``block_tables [B, max_blocks] int32``: block ids
    per sequence, padded. ``max_query_len``/``max_seq_len``: host-side maxima the
    kernels size their grids by.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def check_tokens(self, x: torch.Tensor, name: str) -> None:
        """``x`` has one row per token of ``slot_mapping`` (a host-side shape check: the
        attention kernels size their grids from ``x`` and cannot see a mismatch)."""
        if x.shape[0] != self.slot_mapping.shape[0]:
            raise ValueError(
                f"{name} has {x.shape[0]} rows for a step of {self.slot_mapping.shape[0]} "
                "tokens (slot_mapping): attention takes the real tokens only, no padding rows"
            )
