"""The logits a step samples from: a step that takes only argmaxes reads them in the
model's dtype (no fp32 copy of the whole vocabulary) and makes no device tensors of the
sampling parameters; any other step upcasts them first. Through a real worker (bf16
weights, CPU), against the fp32 upcast of the same logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvscale.server.worker.worker as worker_module
from kvscale.server.config import EngineConfig
from kvscale.server.engine.scheduler import ScheduledBatch
from kvscale.server.engine.sequence import Sequence
from kvscale.server.engine.step_inputs import build_step
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.step import SamplingPlan
from kvscale.server.worker.worker import Worker

BS = 8


@pytest.mark.parametrize(
    ("plan", "argmax_only"),
    [
        (SamplingPlan([None, None], [None, None], all_greedy=True), True),
        (SamplingPlan([None], [None], all_greedy=True, spec_k=3), True),  # greedy verify
        (SamplingPlan([None, 5], [None, None]), False),  # a row samples
        (SamplingPlan([None], [2], all_greedy=True), False),  # logprobs: log_softmax in fp32
        (SamplingPlan([None], [None], all_greedy=True, do_penalties=True), False),
        (SamplingPlan([None], [None], all_greedy=True, ban=True), False),
        (SamplingPlan([None], [None], all_greedy=True, bias=True), False),
        (SamplingPlan([None], [None], all_greedy=True, grammar_rows=[0]), False),
    ],
)
def test_which_steps_take_only_the_argmax(plan: SamplingPlan, argmax_only: bool) -> None:
    assert plan.argmax_only is argmax_only


@pytest.fixture(scope="module")
def worker(llama_ckpt: Path) -> Worker:
    cfg = EngineConfig(
        model=str(llama_ckpt), device="cpu", dtype="bfloat16", num_kv_blocks=16, block_size=BS
    ).resolve()
    return Worker(cfg)


def _prefill(worker: Worker, params: list[SamplingParams]) -> tuple[torch.Tensor, list]:
    """One prefill step of three fixed prompts (the same slots every call); returns the
    logits the sampler was given (their upcast copy, taken before sampling) and the rows'
    (token, logprobs)."""
    vocab = worker.config.model.vocab_size
    rng = np.random.default_rng(3)
    seqs = []
    for i, (table, n) in enumerate(zip([[0, 1], [2], [3, 4]], [11, 6, 9], strict=True)):
        s = Sequence(i, f"r{i}", 0, rng.integers(0, vocab, n).tolist(), params[i])
        s.block_table = table
        seqs.append(s)
    step, _ = build_step(ScheduledBatch(seqs, [11, 6, 9]), BS, 0, {}, vocab)
    fwd = worker.forward(step)
    assert fwd.logits.dtype == torch.bfloat16  # as the model made them, in every case
    logits = fwd.logits.float()
    res = worker.sample(fwd).result()
    return logits, list(zip(res.token_ids, res.logprobs, strict=True))


def test_argmax_steps_read_bf16_logits_and_pick_the_fp32_argmax(worker: Worker) -> None:
    greedy = SamplingParams(temperature=0)
    logits, rows = _prefill(worker, [greedy] * 3)
    assert [t for t, _ in rows] == logits.argmax(dim=-1).tolist()
    # a row that wants logprobs makes the step upcast: same tokens, fp32 logprobs
    with_lp = SamplingParams(temperature=0, logprobs=2)
    logits2, rows2 = _prefill(worker, [greedy, with_lp, greedy])
    torch.testing.assert_close(logits2, logits, rtol=0, atol=0)
    assert [t for t, _ in rows2] == [t for t, _ in rows]
    token, (top_ids, top_lp, lp, rank) = rows2[1]
    want = torch.log_softmax(logits[1], dim=-1)
    assert top_ids[0] == token and rank == 1
    assert lp == pytest.approx(want[token].item(), abs=1e-5)
    assert top_lp == pytest.approx(want.topk(2).values.tolist(), abs=1e-5)
    # a sampled row: drawn from the fp32 distribution; still a token of the vocabulary
    sampled = SamplingParams(temperature=0.8, seed=3)
    _, rows3 = _prefill(worker, [sampled, greedy, greedy])
    assert 0 <= rows3[0][0] < logits.shape[1] and rows3[1:] == rows[1:]


def test_argmax_steps_make_no_sampling_parameter_tensors(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    real = worker_module._sampling_tensors

    def counted(*args: object) -> object:
        made.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_module, "_sampling_tensors", counted)
    greedy = SamplingParams(temperature=0)
    _prefill(worker, [greedy] * 3)
    assert made == []  # two dtype conversions (kernels on a GPU) a step fewer
    _prefill(worker, [SamplingParams(temperature=0.8, seed=1), greedy, greedy])
    assert made == [1]


def test_logits_written_into_a_shared_buffer_are_the_logits(worker: Worker) -> None:
    # a decode graph's path (``DecodeGraphs`` gives every size the first rows of one
    # buffer): the head's product written into ``out`` is the product it returns
    hidden = torch.randn(5, worker.config.model.hidden_size, dtype=torch.bfloat16)
    want = worker.model.compute_logits(hidden)
    buf = torch.full((8, want.shape[1]), float("nan"), dtype=want.dtype)
    got = worker.model.compute_logits(hidden[:3], buf[:3])
    assert got.data_ptr() == buf.data_ptr() and got.shape == (3, want.shape[1])
    torch.testing.assert_close(buf[:3], want[:3], rtol=0, atol=0)
    assert buf[3:].isnan().all()  # rows past the graph's size untouched


def test_the_head_keeps_torchs_gemm_on_the_cpu() -> None:
    # tiles only on CUDA (their choice and the kernels launched: tests/gpu/test_engine_cuda.py)
    from kvscale.server.layers import ops
    from kvscale.server.layers.embedding import head_tiles

    w = torch.zeros(32, 8, dtype=torch.bfloat16)
    with ops.kernels(True):
        assert head_tiles(torch.zeros(1, 8, dtype=torch.bfloat16), w) is None
