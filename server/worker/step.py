"""One model step as plain data: what the driver hands every rank's worker.

The driver (``engine.step_inputs``) turns a scheduled batch into a ``StepInput``: numpy
arrays and a few scalars, never ``Sequence`` objects or ``torch.Generator``s, so that
the same step can be pickled or broadcast to other ranks as it is.

Arrays (``StepInput.arrays``), for T new tokens of B sequences (rows past B are padding
for a CUDA graph of ``graph_size`` rows: id 0, position 0, slot -1, length 1):

- ``ids [T] int64``: token ids; a negative id ``-(r + 1)`` is a placeholder for "the
  token sampled in row r of the previous step", still on the device when this step is
  prepared (``resolve_placeholders``).
- ``positions [T] int64``, ``slots [T] int64`` (cache slot, -1 = not written).
- ``q_start [B+1] int32`` (cumulative new-token offsets), ``seq_lens [B] int32`` (tokens
  in the cache after the step), ``tables [B, W] int32`` (block ids, zero-padded).
- ``logits_idx [S] int64``: the token rows whose logits are sampled (S sampling rows).
- sampling, per sampling row: ``sampling [S, 8] float32`` (temperature, top_k, top_p,
  min_p, greedy, repetition, presence, frequency penalties); optional ``ban_rows``/
  ``ban_cols [N] int64`` (tokens a row may not sample); optional ``prompt_ids``/
  ``output_ids [S, L] int64`` (padded with the vocabulary size) for penalties;
  optional ``bias_rows``/``bias_cols [N] int64`` and ``bias_vals [N] float32`` (logit
  bias added to row, token); optional ``grammar_rows [R] int64``: the sampling rows
  whose tokens a grammar constrains (their bitmask comes at sampling time, see
  ``Worker.sample``).
- speculative verify rows (``engine.step_inputs.verify_inputs``): ``logits_idx`` then
  lists ``1 + d`` rows for a sampling row with ``d`` drafts, and ``spec_*`` arrays say
  which.
- drafts still on the device (an in-process draft model's): ``draft_dst``/``draft_src [D]
  int64``: where in ``ids`` each goes and its flat index in ``StepInput.drafts.tokens``;
  ``draft_spec_dst``/``draft_spec_src`` likewise for the verify arrays.
- prompt logprobs: optional ``plp_idx [P] int64`` (token rows whose logits score a
  prompt token) and ``plp_ids [P] int64`` (that token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class SamplingPlan:
    """What the host knows of a step's sampling rows (one entry per sampling row)."""

    seeds: list[int | None]  # seed of this row's draw (``row_seed``), None: the engine's stream
    logprobs: list[int | None]  # top-k logprobs wanted, None: none
    all_greedy: bool = False
    do_top_k: bool = False
    top_k_max: int = 0  # no row's top_k is larger (0: not known; top-k then sorts whole rows)
    do_top_p_min_p: bool = False
    do_penalties: bool = False
    ban: bool = False
    bias: bool = False
    grammar_rows: list[int] = field(default_factory=list)  # rows a grammar constrains
    prompt_logprobs: int | None = None  # top-k of the prompt-logprob rows (None: none)
    spec_k: int = 0  # most drafts a row verifies (0: no verify rows; see verify_inputs)
    spec_rows: list[int] = field(default_factory=list)  # the verifying sampling rows
    spec_q: bool = False  # the drafts carry their proposal distributions

    @property
    def num_rows(self) -> int:
        return len(self.seeds)

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its logits as the model made them: greedy,
        nothing edits the logits (penalties, bans, biases, grammars), no logprobs. Such a
        step reads the logits in the model's dtype (the argmax of the upcast values is the
        same: upcasting is exact); any other converts them to fp32 first."""
        return (
            self.all_greedy
            and not (self.do_penalties or self.ban or self.bias or self.grammar_rows)
            and all(k is None for k in self.logprobs)
        )


@dataclass
class StepInput:
    arrays: dict[str, np.ndarray]
    num_seqs: int  # B: real rows of the per-sequence arrays
    max_query_len: int  # most new tokens of one sequence
    max_seq_len: int  # longest sequence in the cache after the step
    graph_size: int = 0  # 0: eager; else the captured decode graph to replay (rows padded to it)
    sampling: SamplingPlan = field(default_factory=lambda: SamplingPlan([], []))
    # drafts still on the device (``spec_decode.proposer.DeviceProposal``), which the
    # ``draft_*`` arrays place into the step's inputs: a single rank's steps only
    drafts: Any = None

    @property
    def num_tokens(self) -> int:
        """New tokens fed, padding rows included."""
        return int(self.arrays["ids"].shape[0])

    @property
    def new_tokens_per_seq(self) -> list[int]:
        """New tokens of each real sequence (``[B]``)."""
        return np.diff(self.arrays["q_start"][: self.num_seqs + 1]).tolist()


def as_decode_rows(arrays: dict[str, np.ndarray], num_seqs: int, pad_to: int = 0) -> int:
    """Re-lays a step's ``T`` new tokens of ``num_seqs`` sequences (no padding rows) in
    ``arrays``, in place, as ``T`` one-token rows, padded to ``pad_to`` rows: row t
    attends to its sequence's first ``positions[t] + 1`` tokens through that sequence's
    block table. Every layer writes the step's K/V before attending, so this is the
    same causal attention as the ragged layout: a verify step (1 + k tokens a sequence)
    then replays a decode graph. ``logits_idx`` keeps its token rows. Returns ``T``
    (the step's new ``num_seqs``)."""
    q_start = arrays["q_start"][: num_seqs + 1]
    total = int(q_start[-1])
    pad = max(pad_to, total) - total
    positions = arrays["positions"][:total]
    seq_of = np.repeat(np.arange(num_seqs), np.diff(q_start))
    tables = arrays["tables"][:num_seqs]
    arrays["ids"] = np.concatenate([arrays["ids"][:total], np.zeros(pad, np.int64)])
    arrays["positions"] = np.concatenate([positions, np.zeros(pad, np.int64)])
    arrays["slots"] = np.concatenate([arrays["slots"][:total], np.full(pad, -1, np.int64)])
    arrays["seq_lens"] = np.concatenate([positions + 1, np.ones(pad, np.int64)]).astype(np.int32)
    arrays["q_start"] = np.arange(total + pad + 1, dtype=np.int32)
    arrays["tables"] = np.concatenate([tables[seq_of], np.zeros((pad, tables.shape[1]), np.int32)])
    return total


def resolve_placeholders(ids: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """``ids`` with each placeholder ``-(r + 1)`` replaced by ``last_tokens[r]`` (on the
    device, without a sync); other ids pass through."""
    rows = (-ids - 1).clamp_(min=0)
    return torch.where(ids < 0, last_tokens[rows], ids)


# A sampling row's parameters as the ``sampling`` array holds them (see the module's
# docstring): every transform on, so the profile takes the sampler's costliest path.
COSTLIEST_SAMPLING = (0.7, 50, 0.9, 0.05, 0, 1.1, 0.1, 0.1)


def profile_step(num_tokens: int, block_size: int) -> StepInput:
    """A prefill of ``num_tokens`` tokens of one sequence over blocks 0.., sampling one
    row greedily: the largest forward pass (activation memory), or a calibration pass."""
    n_blocks = -(-num_tokens // block_size)
    pos = np.arange(num_tokens, dtype=np.int64)
    arrays = {
        "ids": np.zeros(num_tokens, dtype=np.int64),
        "positions": pos,
        "slots": pos.copy(),
        "seq_lens": np.array([num_tokens], dtype=np.int32),
        "q_start": np.array([0, num_tokens], dtype=np.int32),
        "tables": np.arange(n_blocks, dtype=np.int32).reshape(1, n_blocks),
        "logits_idx": np.array([num_tokens - 1], dtype=np.int64),
        "sampling": np.array([[1, 0, 1, 0, 1, 1, 0, 0]], dtype=np.float32),
    }
    plan = SamplingPlan([None], [None], all_greedy=True)
    return StepInput(arrays, 1, num_tokens, num_tokens, sampling=plan)


def sampler_profile_step(
    num_tokens: int, block_size: int, rows: int, vocab_size: int, logprobs: int
) -> StepInput:
    """``profile_step`` whose last ``rows`` tokens (at most ``num_tokens``) each sample
    with every transform (temperature, top-k, top-p, min-p, all three penalties) and
    ``logprobs`` top logprobs: the most memory a step's sampling takes (``[rows, V]``
    fp32 logits, their copy for logprobs, the penalties' mask and counts, top-k's sort of
    whole rows; top-p sorts too where its kernel does not run).
    The penalties see no prompt or output token (``prompt_ids``/``output_ids`` hold only
    the padding id ``vocab_size``)."""
    step = profile_step(num_tokens, block_size)
    rows = max(1, min(rows, num_tokens))
    step.arrays["logits_idx"] = np.arange(num_tokens - rows, num_tokens, dtype=np.int64)
    step.arrays["sampling"] = np.tile(np.array(COSTLIEST_SAMPLING, dtype=np.float32), (rows, 1))
    pad = np.full((rows, 1), vocab_size, dtype=np.int64)
    step.arrays["prompt_ids"], step.arrays["output_ids"] = pad, pad.copy()
    step.sampling = SamplingPlan(  # top_k_max unset: top-k sorts whole rows, its costliest way
        [None] * rows,
        [logprobs] * rows,
        do_top_k=True,
        do_top_p_min_p=True,
        do_penalties=True,
    )
    return step
