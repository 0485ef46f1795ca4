"""Hugging Face transformers as the reference implementation for parity tests."""

from __future__ import annotations

from pathlib import Path

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
