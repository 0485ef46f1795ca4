"""Hugging Face transformers as the reference implementation for parity tests, and the
comparisons those tests share (greedy agreement, stability, logprob gaps)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' ``generate`` (fp32, one prompt at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def token_in_text(tokenizer: Any, token_id: int) -> str:
    """A token's text inside running text (what logprobs' token strings hold): a decode
    of another token and it, minus that token's decode. A lone decode can differ: a
    SentencePiece decoder strips the space from a text's first word ("▁er" -> "er")."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
    before = tokenizer.decode([anchor])
    return tokenizer.decode([anchor, token_id])[len(before) :]


def random_prompts(n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """``n`` prompts of token ids (BOS first), lengths drawn from ``lengths`` inclusive."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        body = torch.randint(3, 32000, (length - 1,), generator=gen).tolist()
        prompts.append([1, *body])
    return prompts


def assert_greedy_agrees_up_to_near_ties(
    base: list, got: list[list[int]], atol: float, max_diverged: int
) -> None:
    """Greedy runs of one model that differ only in accumulation order (chunking,
    preemption, batch shape) agree token for token until a near tie: where a sequence of
    ``got`` first departs from ``base`` (``CompletionOutput``s with logprobs), the token it
    took must be within ``atol`` of the base run's choice there. At most ``max_diverged``
    sequences may depart at all."""
    diverged = 0
    for b, g in zip(base, got, strict=True):
        pairs = enumerate(zip(b.token_ids, g, strict=True))
        j = next((i for i, (x, y) in pairs if x != y), None)
        if j is None:
            continue
        diverged += 1
        lps = b.logprobs[j]
        assert g[j] in lps, (j, g[j], "not even among the base run's top tokens")
        gap = lps[b.token_ids[j]].logprob - lps[g[j]].logprob
        assert gap < atol, (j, gap)
    assert diverged <= max_diverged, diverged


# chunked prefill (16-token budget), then preemption (too few KV blocks)
CHUNKING = (
    dict(max_num_batched_tokens=16, max_num_seqs=16),
    dict(num_kv_blocks=14, max_model_len=96, block_size=8),
)


def assert_stable_under_chunking(
    path: Path, prompts: list[list[int]], atol: float, max_diverged: int = 3
) -> None:
    """Greedy tokens of ``path`` with chunked prefill, then with preemption forced, agree
    with an unconstrained run up to near ties (``assert_greedy_agrees_up_to_near_ties``),
    and every KV block is free at the end."""
    from kvscale.server import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    base = [o.outputs[0] for o in LLM(str(path), device="cpu").generate(prompts, params)]
    for kw in CHUNKING:
        llm = LLM(str(path), device="cpu", **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_greedy_agrees_up_to_near_ties(base, got, atol, max_diverged)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        if "num_kv_blocks" in kw:
            assert llm.engine.stats().num_preemptions > 0


# a transformers Linear -> (kvscale's fused layer holding it, which output shard)
FUSED_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


def linear_layer_pairs(
    ref: torch.nn.Module, ours: torch.nn.Module, prompt: list[int]
) -> Iterator[tuple[str, torch.nn.Module, Any, int, torch.Tensor, torch.Tensor]]:
    """Runs transformers' ``ref`` on ``prompt`` and yields, for each of its linear layers
    but ``lm_head``: its name, the layer, kvscale's layer holding it (in ``ours``), the
    output shard index there, and the layer's input ``[T, in]`` and output ``[T, out]``."""
    seen: dict[str, tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = {}
    for n, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            m.register_forward_hook(
                lambda mod, a, out, n=n: seen.__setitem__(n, (mod, a[0][0].detach(), out[0]))
            )
    with torch.no_grad():
        ref(torch.tensor([prompt]))
    assert len(seen) == 7 * ref.config.num_hidden_layers
    modules = dict(ours.named_modules())
    for n, (hf, x, y) in seen.items():
        head, _, leaf = n.rpartition(".")
        fused, shard = FUSED_SHARDS.get(leaf, (leaf, 0))
        yield n, hf, modules[f"{head}.{fused}"], shard, x, y.detach()


def prompt_logprob_gap(a: list[Any], b: list[Any]) -> float:
    """Mean |difference| of two runs' teacher-forced log-probabilities of the prompt tokens
    (``RequestOutput.prompt_logprobs``, asked for with ``prompt_logprobs=0``): how far
    apart two numerically different engines are, position by position, with no greedy
    divergence compounding it."""
    gaps = [
        abs(pa[tok].logprob - pb[tok].logprob)
        for oa, ob in zip(a, b, strict=True)
        for tok, pa, pb in zip(
            oa.prompt_token_ids, oa.prompt_logprobs, ob.prompt_logprobs, strict=True
        )
        if pa is not None and pb is not None
    ]
    return sum(gaps) / len(gaps)


def fp8_tp2_and_quantization_gaps(
    path: Path, prompts: list[list[int]], **kw: Any
) -> tuple[float, float]:
    """(FP8 TP=2 against FP8 TP=1, FP8 TP=1 against bf16 TP=1): prompt-logprob gaps of a
    bf16 checkpoint quantized at load. Row-parallel layers quantize each rank's half of
    their input with its own per-token scale, so TP=2 rounds differently from TP=1; that
    difference must stay within the quantization's own (it is the same kind of error)."""
    from kvscale.server import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for name, extra in {
        "bf16": dict(tensor_parallel_size=1),
        "fp8-tp1": dict(tensor_parallel_size=1, quantization="fp8"),
        "fp8-tp2": dict(tensor_parallel_size=2, quantization="fp8"),
    }.items():
        llm = LLM(str(path), dtype="bfloat16", **extra, **kw)
        try:
            runs[name] = llm.generate(prompts, params)
        finally:
            llm.engine.core.shutdown()
            del llm
    return (
        prompt_logprob_gap(runs["fp8-tp2"], runs["fp8-tp1"]),
        prompt_logprob_gap(runs["fp8-tp1"], runs["bf16"]),
    )
