"""Host-side inputs of one model step, as numpy arrays (no torch, no device).

The scheduler's batch becomes one flat token stream: ``ids``, ``positions`` and cache
``slots`` per new token; ``q_start`` (cumulative new-token offsets), ``seq_lens`` and
padded ``tables`` per sequence; ``logits_idx``, the rows of the stream whose logits are
sampled (the last token of each sequence whose prompt is then fully in the cache).

Token ids may be negative placeholders, ``-(r + 1)``: "the token sampled in row ``r`` of
the previous step", still on the device when this step is prepared (see
``resolve_placeholders``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscale.server.engine.scheduler import ScheduledBatch


@dataclass
class StepPlan:
    arrays: dict[str, np.ndarray]
    sample_rows: list[int]  # batch indices that sample, in batch order
    q_starts: list[int]  # [B+1]
    seq_lens: list[int]  # [B]
    max_query_len: int
    max_seq_len: int

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def plan_step(batch: ScheduledBatch, block_size: int, pad_to: int = 0) -> StepPlan:
    """The step's arrays. ``pad_to`` > len(batch) (decode-only steps replayed from a CUDA
    graph) adds padding rows: id 0, position 0, slot -1 (not written), one token of block 0.
    """
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_starts = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    logits_idx: list[int] = []
    width = 1
    for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        ids.extend(seq.token_ids[start:end])
        if n == 1:
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            pos = np.arange(start, end)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
        q_starts.append(q_starts[-1] + n)
        seq_lens.append(end)
        width = max(width, len(table))
        if end == seq.num_tokens:
            sample_rows.append(b)
            logits_idx.append(q_starts[-1] - 1)
    n_rows = len(batch.seqs)
    rows = max(pad_to, n_rows)
    pad = rows - n_rows
    end = q_starts[-1]
    tables = np.zeros((rows, width), dtype=np.int32)
    for b, seq in enumerate(batch.seqs):
        tables[b, : len(seq.block_table)] = seq.block_table
    arrays = {
        "ids": np.array(ids + [0] * pad, dtype=np.int64),
        "positions": np.array(positions + [0] * pad, dtype=np.int64),
        "slots": np.array(slots + [-1] * pad, dtype=np.int64),
        "seq_lens": np.array(seq_lens + [1] * pad, dtype=np.int32),
        "q_start": np.array(q_starts + list(range(end + 1, end + pad + 1)), dtype=np.int32),
        "tables": tables,
        "logits_idx": np.array(logits_idx, dtype=np.int64),
    }
    return StepPlan(
        arrays=arrays,
        sample_rows=sample_rows,
        q_starts=q_starts,
        seq_lens=seq_lens,
        max_query_len=max(batch.num_new_tokens),
        max_seq_len=max(seq_lens),
    )


def padded_rows(rows: list[list[int]], pad: int) -> np.ndarray:
    """Ragged int lists -> ``[len(rows), max_len]`` int64 padded with ``pad`` (width >= 1)."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def resolve_placeholders(ids: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """``ids`` with each placeholder ``-(r + 1)`` replaced by ``last_tokens[r]`` (on the
    device, without a sync); other ids pass through."""
    rows = (-ids - 1).clamp_(min=0)
    return torch.where(ids < 0, last_tokens[rows], ids)
