"""torch.compile (Inductor) of the non-attention parts gives the eager engine's tokens."""

from __future__ import annotations

from pathlib import Path

from kvscale.server import LLM, SamplingParams
from tests.hf_reference import random_prompts

PROMPTS = random_prompts(8, (2, 60), seed=1)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# chunked prefill and preemption, so compiled code sees many token counts
MODE = dict(
    device="cpu",
    max_num_batched_tokens=32,
    max_num_seqs=8,
    num_kv_blocks=12,
    block_size=8,
    max_model_len=96,
)


def test_compiled_model_matches_eager(llama_ckpt: Path) -> None:
    eager = LLM(str(llama_ckpt), **MODE)
    ref = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)]
    compiled = LLM(str(llama_ckpt), compile=True, **MODE)
    assert "OptimizedModule" in type(compiled.engine.worker.model.model).__name__
    got = [o.outputs[0].token_ids for o in compiled.generate(PROMPTS, GREEDY)]
    assert compiled.engine.stats().num_preemptions > 0
    assert got == ref


def test_compiled_model_does_not_recompile_for_new_step_sizes(llama_ckpt: Path) -> None:
    """One graph for single-token steps and one dynamic graph for the rest: steps of new
    sizes (and inputs at new offsets in the packed transfer) reuse them."""
    import torch._dynamo

    llm = LLM(str(llama_ckpt), compile=True, **MODE)
    llm.generate(PROMPTS[:1], GREEDY)  # compiles for T >= 2 (prefill) and T == 1 (decode)
    torch._dynamo.config.error_on_recompile = True
    try:
        outs = llm.generate(random_prompts(8, (61, 90), seed=2), GREEDY)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
