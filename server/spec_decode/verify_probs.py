"""The target's distributions at a verify step's ``k + 1`` positions per sequence, after
the request's penalties, temperature, top-k, top-p and min-p, computed by the same
function as ``layers.sampler.sample`` (``target_distribution``, so a row's probabilities are
bit-identical to what normal sampling would draw from at that position).

Penalties see the drafted tokens before each position as generated output: position ``j``
of a sequence counts its output so far plus drafts ``0..j-1`` (``verify_output_counts``),
as normal decoding would after accepting them.
"""

from __future__ import annotations

import torch

from kvscale.server.layers.sampler import SamplingTensors, target_distribution


def expand_rows(t: SamplingTensors, repeats: int) -> SamplingTensors:
    """Each row's parameters repeated ``repeats`` times (row-major: a sequence's
    positions are adjacent)."""

    def rep(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(repeats, dim=0)

    return SamplingTensors(
        temperature=rep(t.temperature),
        top_k=rep(t.top_k),
        top_p=rep(t.top_p),
        min_p=rep(t.min_p),
        greedy=rep(t.greedy),
        repetition_penalty=rep(t.repetition_penalty),
        presence_penalty=rep(t.presence_penalty),
        frequency_penalty=rep(t.frequency_penalty),
        do_top_k=t.do_top_k,
        do_top_p_min_p=t.do_top_p_min_p,
        do_penalties=t.do_penalties,
        all_greedy=t.all_greedy,
        top_k_max=t.top_k_max,
    )


def verify_output_counts(
    output_counts: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor
) -> torch.Tensor:
    """``output_counts [N, V]`` -> ``[N * (K + 1), V]``: position ``j`` adds the drafted
    tokens before it (only the ``num_draft`` real ones)."""
    n, k = drafts.shape
    vocab = output_counts.shape[1]
    valid = torch.arange(k, device=drafts.device).unsqueeze(0) < num_draft.unsqueeze(1)
    one_hot = torch.zeros(n, k, vocab, dtype=output_counts.dtype, device=drafts.device)
    one_hot.scatter_(
        2, torch.where(valid, drafts, 0).unsqueeze(2), valid.unsqueeze(2).to(one_hot.dtype)
    )
    before = torch.cat([torch.zeros_like(one_hot[:, :1]), one_hot.cumsum(dim=1)], dim=1)
    return (output_counts.unsqueeze(1) + before).reshape(n * (k + 1), vocab)


def verify_probs(
    logits: torch.Tensor,
    t: SamplingTensors,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [M, V]`` fp32 (modified in place), one row per verified position, with
    ``t`` (and the penalty inputs) already per position (``expand_rows``,
    ``verify_output_counts``). Returns ``(probs [M, V], greedy_tokens [M])``: the greedy
    tokens are the argmax after penalties, as ``sample`` takes them."""
    probs, greedy_tokens = target_distribution(logits, t, prompt_mask, output_counts)
    if probs is None:  # all greedy: the penalised logits' own distribution
        probs = torch.softmax(logits, dim=-1)
    return probs, greedy_tokens
