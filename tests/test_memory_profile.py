"""The step the KV pool is sized around: the largest prefill, whose last rows sample as
many rows as one step can on the sampler's costliest path (``Worker.profile_memory``;
on CUDA its peak memory is what the pool leaves room for). Through a real CPU worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.sampling_params import MAX_LOGPROBS
from kvscale.server.worker.step import COSTLIEST_SAMPLING, sampler_profile_step
from kvscale.server.worker.worker import Worker


def test_the_profile_step_samples_its_last_rows_with_every_transform() -> None:
    step = sampler_profile_step(40, 16, rows=6, vocab_size=1000, logprobs=MAX_LOGPROBS)
    a, plan = step.arrays, step.sampling
    assert a["logits_idx"].tolist() == list(range(34, 40))
    assert a["sampling"].shape == (6, 8)
    assert a["sampling"][:, 4].tolist() == [0.0] * 6  # no row greedy
    assert np.allclose(a["sampling"][0], COSTLIEST_SAMPLING)
    assert a["prompt_ids"].shape == a["output_ids"].shape == (6, 1)
    assert (a["prompt_ids"] == 1000).all() and (a["output_ids"] == 1000).all()  # padding
    assert plan.num_rows == 6 and plan.logprobs == [MAX_LOGPROBS] * 6
    assert plan.do_top_k and plan.do_top_p_min_p and plan.do_penalties
    assert not plan.all_greedy and not plan.argmax_only
    assert (step.num_seqs, step.max_query_len, step.max_seq_len) == (1, 40, 40)
    # never more rows than the prefill has tokens
    assert sampler_profile_step(5, 16, 64, 1000, 2).sampling.num_rows == 5


@pytest.mark.parametrize(
    ("settings", "rows"),
    [
        (dict(max_num_seqs=4), 4),
        # under speculation every sequence verifies num_speculative_tokens + 1 rows
        (dict(max_num_seqs=4, speculative_method="ngram", num_speculative_tokens=3), 16),
        # 16 x 4 verify rows, capped at the step's 32 tokens
        (dict(max_num_seqs=16, speculative_method="ngram", num_speculative_tokens=3), 32),
    ],
)
def test_the_worker_profiles_a_full_batch_of_sampling_rows(
    llama_ckpt: Path, settings: dict, rows: int
) -> None:
    cfg = EngineConfig(
        model=str(llama_ckpt),
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        block_size=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        **settings,
    ).resolve()
    worker = Worker(cfg)
    rng = worker.generator.get_state()
    tokens = worker.profile_memory(cfg.max_num_batched_tokens)
    assert tokens.shape == (rows,)
    assert ((tokens >= 0) & (tokens < cfg.model.vocab_size)).all()
    assert torch.equal(worker.generator.get_state(), rng)  # the seeded stream untouched
    assert worker.kv_pool.num_blocks == 0  # the profile's pool is freed
