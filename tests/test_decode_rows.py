"""Verify steps laid out as one-token rows (``as_decode_rows``, what lets them replay a
decode CUDA graph): the same logits and the same verified tokens as the ragged layout,
through a real worker (fp32, CPU), and padding rows that write nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.engine.scheduler import ScheduledBatch
from kvscale.server.engine.sequence import Sequence
from kvscale.server.engine.step_inputs import build_step
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.step import as_decode_rows
from kvscale.server.worker.worker import Worker

BS = 8


def test_decode_rows_repeat_each_sequences_table_per_token() -> None:
    arrays = {
        "ids": np.array([7, 8, 9, 5], np.int64),
        "positions": np.array([4, 5, 6, 2], np.int64),
        "slots": np.array([20, 21, 22, 2], np.int64),
        "q_start": np.array([0, 3, 4], np.int32),
        "seq_lens": np.array([7, 3], np.int32),
        "tables": np.array([[3, 5], [0, 0]], np.int32),
        "logits_idx": np.array([0, 1, 2, 3], np.int64),
    }
    assert as_decode_rows(arrays, 2, pad_to=6) == 4  # blocks of 4 tokens
    assert arrays["seq_lens"].tolist() == [5, 6, 7, 3, 1, 1]  # causal: position + 1
    assert arrays["q_start"].tolist() == list(range(7))
    assert arrays["tables"].tolist() == [[3, 5]] * 3 + [[0, 0]] * 3
    assert arrays["slots"].tolist() == [20, 21, 22, 2, -1, -1]  # padding writes nothing
    assert arrays["ids"].tolist() == [7, 8, 9, 5, 0, 0]
    assert arrays["logits_idx"].tolist() == [0, 1, 2, 3]


def _verify_batch(worker: Worker, vocab: int) -> ScheduledBatch:
    """Two sequences whose prompts are in the cache, each feeding its last token and
    3 (resp. 1) drafts; a third with no drafts."""
    rng = np.random.default_rng(0)
    seqs, tables, lens = [], [[0, 1], [2, 3], [4]], [7, 10, 5]
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        prompt = rng.integers(0, vocab, n).tolist()
        s = Sequence(i, f"r{i}", 0, prompt, SamplingParams(temperature=0))
        s.block_table = table
        seqs.append(s)
    prefill = ScheduledBatch(seqs, [n - 1 for n in lens])  # all but the last token
    for s in seqs:
        s.num_computed_tokens = 0
    step, _ = build_step(prefill, BS, 0, {}, vocab)
    worker.launch(step).result()
    drafts = [[1, 2, 3], [4], []]
    for s, d, n in zip(seqs, drafts, lens, strict=True):
        s.num_computed_tokens = n - 1
        s.draft_tokens = d
    return ScheduledBatch(seqs, [1 + len(d) for d in drafts])


def test_a_verify_step_as_decode_rows_matches_the_ragged_layout(llama_ckpt: Path) -> None:
    cfg = EngineConfig(
        model=str(llama_ckpt), device="cpu", dtype="float32", num_kv_blocks=16, block_size=BS
    ).resolve()
    worker = Worker(cfg)
    vocab = cfg.model.vocab_size
    batch = _verify_batch(worker, vocab)
    ragged, _ = build_step(batch, BS, 0, {}, vocab)
    rows, _ = build_step(batch, BS, 0, {}, vocab, decode_rows=True)
    padded, _ = build_step(batch, BS, 8, {}, vocab, decode_rows=True)
    padded.graph_size = 0  # no CUDA graph on the CPU: the padded rows run eagerly
    assert ragged.max_query_len == 4 and rows.max_query_len == 1
    assert rows.num_seqs == 7 and padded.num_tokens == 8
    results = []
    for step in (ragged, rows, padded):
        fwd = worker.forward(step)
        logits = fwd.logits.clone()
        res = worker.sample(fwd).result()
        results.append((logits, res.token_ids, res.spec_tokens))
    ref = results[0]
    assert ref[0].shape[0] == 7  # 4 + 2 verify positions and 1 decode position
    assert sorted(ref[2]) == [0, 1]  # the verify rows' emitted tokens
    for logits, tokens, spec in results[1:]:
        torch.testing.assert_close(logits, ref[0], rtol=1e-5, atol=1e-5)
        assert tokens == ref[1]
        assert spec == ref[2]
