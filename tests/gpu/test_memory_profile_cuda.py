"""The KV pool's profile counts the sampler's memory (GPU machine only): the profile step's
peak exceeds a forward-only profile of the same prefill by at least the [rows, V] fp32
tensors every sampling path makes (the upcast logits, their copy for logprobs, the
probabilities)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.worker.host_to_device import to_device
from kvscale.server.worker.step import profile_step
from kvscale.server.worker.worker import Worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, ROWS = 512, 256


def _peak(run) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_the_profile_peak_includes_a_full_batch_of_sampling(llama_ckpt: Path) -> None:
    cfg = EngineConfig(
        model=str(llama_ckpt),
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_seqs=ROWS,
        max_num_batched_tokens=TOKENS,
        enforce_eager=True,
    ).resolve()
    worker = Worker(cfg)
    vocab = cfg.model.vocab_size

    def forward_only() -> None:
        step = profile_step(TOKENS, worker.block_size)
        worker.resize_kv_pool(-(-TOKENS // worker.block_size))
        with torch.inference_mode():
            worker._forward_eager(step, to_device(step.arrays, worker.device))
        worker.resize_kv_pool(0)  # as profile_memory leaves it

    old = _peak(forward_only)
    new = _peak(lambda: worker.profile_memory(TOKENS))
    assert new - old >= 3 * ROWS * vocab * 4, (old, new, vocab)
