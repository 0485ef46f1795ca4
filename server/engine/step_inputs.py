"""The driver's half of a step: a scheduled batch becomes a ``StepInput`` (plain arrays,
see ``worker.step`` for their meaning), the only thing the worker is given.

``plan_step`` flattens the batch's new tokens into one stream (ids, positions, cache
slots, per-sequence offsets and block tables, and the rows that sample: the last token
of each sequence whose prompt is then fully in the cache); ``build_step`` adds the
sampling inputs of those rows (parameters, banned tokens, penalty histories and
per-row seeds) and wraps it all up. ``prompt_logprob_inputs`` adds the token rows
whose logits score the next prompt token, for sequences that asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscale.server.engine.scheduler import ScheduledBatch
from kvscale.server.engine.sequence import Sequence
from kvscale.server.layers.sampler import row_seed
from kvscale.server.spec_decode.proposer import DeviceProposal
from kvscale.server.worker.step import SamplingPlan, StepInput, as_decode_rows


@dataclass
class StepPlan:
    arrays: dict[str, np.ndarray]
    sample_rows: list[int]  # batch indices that sample, in batch order
    num_draft: list[int]  # per sampling row: drafts it verifies (its logits rows: 1 + that)
    max_query_len: int
    max_seq_len: int
    num_rows: int  # real rows of the per-sequence arrays: sequences, or tokens (decode_rows)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def plan_step(
    batch: ScheduledBatch, block_size: int, pad_to: int = 0, decode_rows: bool = False
) -> StepPlan:
    """The step's arrays. ``pad_to`` > len(batch) (decode-only steps replayed from a CUDA
    graph) adds padding rows: id 0, position 0, slot -1 (not written), one token of block 0.
    ``decode_rows``: one row per new token (``worker.step.as_decode_rows``; verify steps
    replayed from a decode graph), padded to ``pad_to`` rows.
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
    num_draft: list[int] = []  # per sampling row: drafted tokens it verifies
    draft_dst: list[int] = []  # drafts still on the device: where they go in ``ids``
    draft_src: list[int] = []  # and where they come from (``seq.draft_src``)
    for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        drafts = max(0, end - seq.num_tokens)  # the drafts follow the sequence's tokens
        ids.extend(seq.token_ids[start : end - drafts])
        if drafts:
            if seq.draft_src >= 0:
                draft_dst.extend(range(len(ids), len(ids) + drafts))
                draft_src.extend(range(seq.draft_src, seq.draft_src + drafts))
            ids.extend(seq.draft_tokens[:drafts])
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
        if end >= seq.num_tokens:
            sample_rows.append(b)
            # a verify row: the logits of its last token and of each draft
            logits_idx.extend(range(q_starts[-1] - 1 - drafts, q_starts[-1]))
            num_draft.append(drafts)
    n_rows = len(batch.seqs)
    rows = n_rows if decode_rows else max(pad_to, n_rows)
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
    if draft_dst:  # token order: the same positions after ``as_decode_rows``
        arrays["draft_dst"] = np.array(draft_dst, dtype=np.int64)
        arrays["draft_src"] = np.array(draft_src, dtype=np.int64)
    num_rows = as_decode_rows(arrays, n_rows, pad_to) if decode_rows else n_rows
    return StepPlan(
        arrays=arrays,
        sample_rows=sample_rows,
        num_draft=num_draft,
        max_query_len=1 if decode_rows else max(batch.num_new_tokens),
        max_seq_len=max(seq_lens),
        num_rows=num_rows,
    )


def padded_rows(rows: list[list[int]], pad: int) -> np.ndarray:
    """Ragged int lists -> ``[len(rows), max_len]`` int64 padded with ``pad`` (width >= 1)."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def build_step(
    batch: ScheduledBatch,
    block_size: int,
    graph_size: int,
    banned: dict[int, list[int]],
    vocab_size: int,
    decode_rows: bool = False,
    drafts: DeviceProposal | None = None,
) -> tuple[StepInput, list[Sequence]]:
    """The step of ``batch`` and its sampling sequences (in sampling-row order).
    ``graph_size`` > 0: a decode step padded to that captured graph's rows;
    ``decode_rows``: laid out one row per new token (see ``plan_step``).
    ``banned[seq_id]``: tokens that sequence may not sample now (EOS before min_tokens).
    ``drafts``: the drafts still on the device that sequences' ``draft_src`` point into
    (``Speculator.on_device``); the step carries them for ``Worker._place_drafts``."""
    plan = plan_step(batch, block_size, graph_size, decode_rows)
    seqs = [batch.seqs[b] for b in plan.sample_rows]
    sampling = sampling_inputs(seqs, banned, vocab_size, plan.arrays)
    if any(plan.num_draft):
        q_width = 0
        if drafts is not None and drafts.q_ids is not None:
            q_width = int(drafts.q_ids.shape[-1])
        sampling.spec_k, sampling.spec_q = verify_inputs(seqs, plan.num_draft, plan.arrays, q_width)
        sampling.spec_rows = plan.arrays["spec_rows"].tolist()
    step = StepInput(
        plan.arrays, plan.num_rows, plan.max_query_len, plan.max_seq_len, graph_size, sampling
    )
    if "draft_src" in plan.arrays:
        assert drafts is not None, "sequences point into device drafts the step was not given"
        step.drafts = drafts
    return step, seqs


def prompt_logprob_inputs(batch: ScheduledBatch, step: StepInput) -> list[tuple[Sequence, int]]:
    """Adds ``plp_idx``/``plp_ids [P] int64`` to ``step``: the token rows (of the step's
    stream) whose logits score a prompt token, and that token, for each sequence that
    wants prompt logprobs (``seq.prompt_lp_next``: the first prompt position not yet
    asked for; position j scores prompt token j + 1). Returns each such sequence with
    its count of rows, in row order; sets ``step.sampling.prompt_logprobs`` to the
    largest top-k asked for (None: no rows)."""
    q_start = step.arrays["q_start"]
    rows: list[int] = []
    ids: list[int] = []
    out: list[tuple[Sequence, int]] = []
    k = 0
    for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        if seq.prompt_lps is None:
            continue
        start = seq.num_computed_tokens
        lo = max(start, seq.prompt_lp_next)
        hi = min(start + n, seq.num_prompt_tokens - 1)
        if lo >= hi:
            continue
        base = int(q_start[b]) - start
        rows.extend(range(base + lo, base + hi))
        ids.extend(seq.prompt_token_ids[lo + 1 : hi + 1])
        out.append((seq, hi - lo))
        k = max(k, seq.params.prompt_logprobs or 0)
    if rows:
        step.arrays["plp_idx"] = np.array(rows, dtype=np.int64)
        step.arrays["plp_ids"] = np.array(ids, dtype=np.int64)
        step.sampling.prompt_logprobs = k
    return out


def verify_inputs(
    seqs: list[Sequence],
    num_draft: list[int],
    arrays: dict[str, np.ndarray],
    device_q_width: int = 0,
) -> tuple[int, bool]:
    """Adds the arrays of a step's verify rows (sampling rows with drafts) to ``arrays``;
    returns ``(K, whether drafts carry distributions)``. For ``S`` sampling rows, ``N``
    of which verify, ``K`` = most drafts of a row:

    - ``spec_last [S] int64``: the logits row of each sampling row's last position (what
      normal sampling reads);
    - ``spec_rows [N] int64``: the verifying sampling rows; ``spec_idx [N, K + 1] int64``:
      the logits rows of their positions (padded with the last one);
    - ``spec_draft [N, K] int64`` (-1 padded), ``spec_num_draft [N] int64``;
    - with distributions: ``spec_q_ids [N, K, M] int64``, ``spec_q_probs [N, K, M]
      float32`` (point masses for drafts without one);
    - drafts still on the device (``seq.draft_src`` >= 0): placeholders above, and
      ``draft_spec_dst``/``draft_spec_src [D] int64``: the flat index in ``spec_draft``
      (and row of ``spec_q_* [N * K, M]``) of each such draft, and its flat index in the
      device drafts; ``device_q_width`` > 0: those carry distributions of that width."""
    ends = np.cumsum(np.asarray(num_draft, dtype=np.int64) + 1)
    arrays["spec_last"] = ends - 1
    rows = [r for r, d in enumerate(num_draft) if d]
    k = max(num_draft)
    n = len(rows)
    idx = np.empty((n, k + 1), dtype=np.int64)
    draft = np.full((n, k), -1, dtype=np.int64)
    nd = np.zeros(n, dtype=np.int64)
    qs = [seqs[r].draft_q for r in rows]
    with_q = device_q_width > 0 or any(q is not None for q in qs)
    m = max(1, device_q_width, *(q[0].shape[1] for q in qs if q is not None))
    spec_dst: list[int] = []
    spec_src: list[int] = []
    q_ids = np.zeros((n, k, m), dtype=np.int64)
    q_probs = np.zeros((n, k, m), dtype=np.float32)
    for i, r in enumerate(rows):
        d = num_draft[r]
        first = ends[r] - 1 - d
        idx[i] = first + np.minimum(np.arange(k + 1), d)
        draft[i, :d] = seqs[r].draft_tokens[:d]
        nd[i] = d
        src = seqs[r].draft_src
        if src >= 0:
            spec_dst.extend(range(i * k, i * k + d))
            spec_src.extend(range(src, src + d))
        q = qs[i]
        if q is None:
            q_ids[i, :d, 0] = draft[i, :d]
            q_probs[i, :d, 0] = 1.0
        else:
            q_ids[i, :d, : q[0].shape[1]] = q[0][:d]
            q_probs[i, :d, : q[1].shape[1]] = q[1][:d]
    arrays.update(spec_rows=np.asarray(rows, dtype=np.int64), spec_idx=idx, spec_draft=draft)
    arrays["spec_num_draft"] = nd
    if spec_dst:
        arrays["draft_spec_dst"] = np.array(spec_dst, dtype=np.int64)
        arrays["draft_spec_src"] = np.array(spec_src, dtype=np.int64)
    if with_q:
        arrays["spec_q_ids"], arrays["spec_q_probs"] = q_ids, q_probs
    return k, with_q


def sampling_inputs(
    seqs: list[Sequence],
    banned: dict[int, list[int]],
    vocab_size: int,
    arrays: dict[str, np.ndarray],
) -> SamplingPlan:
    """Adds the sampling arrays of ``seqs`` (one row each) to ``arrays``; returns what the
    host knows of them."""
    ps = [s.params for s in seqs]
    arrays["sampling"] = np.array(
        [
            (
                p.temperature,
                p.top_k,
                p.top_p,
                p.min_p,
                p.greedy,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
            for p in ps
        ],
        dtype=np.float32,
    ).reshape(len(ps), 8)
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for row, seq in enumerate(seqs):
        ban = banned.get(seq.seq_id)
        if ban:
            ban_rows.extend([row] * len(ban))
            ban_cols.extend(ban)
    if ban_rows:
        arrays["ban_rows"] = np.array(ban_rows, dtype=np.int64)
        arrays["ban_cols"] = np.array(ban_cols, dtype=np.int64)
    do_pen = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in ps)
    if do_pen:
        # pad id = vocab, a spare last column; output ids may hold placeholders
        arrays["prompt_ids"] = padded_rows([s.prompt_token_ids for s in seqs], vocab_size)
        arrays["output_ids"] = padded_rows([s.output_token_ids for s in seqs], vocab_size)
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for row, p in enumerate(ps):
        if p.logit_bias:
            bias_rows.extend([row] * len(p.logit_bias))
            bias_cols.extend(p.logit_bias)
            bias_vals.extend(p.logit_bias.values())
    if bias_rows:
        arrays["bias_rows"] = np.array(bias_rows, dtype=np.int64)
        arrays["bias_cols"] = np.array(bias_cols, dtype=np.int64)
        arrays["bias_vals"] = np.array(bias_vals, dtype=np.float32)
    grammar_rows = [row for row, s in enumerate(seqs) if s.grammar is not None]
    if grammar_rows:
        arrays["grammar_rows"] = np.array(grammar_rows, dtype=np.int64)
    top_k_max = max((p.top_k for p in ps), default=0)  # 0: no row sets top-k
    return SamplingPlan(
        seeds=[
            None if s.params.seed is None else row_seed(s.params.seed, s.num_output_tokens)
            for s in seqs
        ],
        logprobs=[p.logprobs for p in ps],
        all_greedy=all(p.greedy for p in ps),
        do_top_k=top_k_max > 0,
        top_k_max=top_k_max,
        do_top_p_min_p=any(p.top_p < 1 or p.min_p > 0 for p in ps),
        do_penalties=do_pen,
        ban=bool(ban_rows),
        bias=bool(bias_rows),
        grammar_rows=grammar_rows,
    )
