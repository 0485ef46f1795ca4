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
