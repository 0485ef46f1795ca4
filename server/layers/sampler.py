"""Batched sampling math: penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs.

All functions take fp32 logits ``[N, V]`` (one row per sequence that samples this step;
steps that take only the argmax pass the model's dtype: ``SamplingPlan.argmax_only``) and
per-row parameter tensors ``[N]`` on the same device, with no per-row Python loop
except the draw for rows that carry their own seeded generator, and no device-to-host
sync: what must be known on the host (all rows greedy? any top-k?) comes as flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscale.server.layers import ops


@dataclass
class SamplingTensors:
    """Per-row parameters. ``top_k`` 0 = off; ``greedy`` rows take the argmax."""

    temperature: torch.Tensor  # [N] fp32
    top_k: torch.Tensor  # [N] int64
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    greedy: torch.Tensor  # [N] bool
    repetition_penalty: torch.Tensor  # [N] fp32
    presence_penalty: torch.Tensor  # [N] fp32
    frequency_penalty: torch.Tensor  # [N] fp32
    do_top_k: bool
    do_top_p_min_p: bool
    do_penalties: bool
    all_greedy: bool = False  # decided on the host: no device sync to find out
    top_k_max: int = 0  # the largest top_k of the rows that set one (host-known); 0: unknown


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM/OpenAI semantics, in place.

    Repetition (HF/CTRL): tokens seen in prompt or output get positive logits divided,
    negative multiplied. Presence/frequency: subtract ``presence * [count > 0]`` and
    ``frequency * count`` for tokens generated so far. ``prompt_mask [N, V]`` bool,
    ``output_counts [N, V]`` int.
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    counts = output_counts.to(logits.dtype)
    logits -= frequency.unsqueeze(1) * counts
    logits -= presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor
) -> torch.Tensor:
    """Adds ``vals [N]`` to ``logits[rows[i], cols[i]]`` (OpenAI's logit_bias), in place."""
    return logits.index_put_((rows, cols), vals, accumulate=True)


_BITS = {}  # device -> arange(32) int32


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """Sets to -inf the tokens a grammar does not allow, in place, on the device.

    ``rows [R]`` int64: the rows of ``logits [N, V]`` a grammar constrains; ``bitmask
    [R, ceil(V / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` set = token t allowed."""
    n_rows, width = bitmask.shape
    vocab = logits.shape[1]
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(n_rows, width * 32)[:, :vocab].bool()
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, sub)


# Largest top-k (over a batch's rows) found by partial selection (``torch.topk``) rather
# than a sort of the whole vocabulary; clients ask for tens (OpenAI-style top_k 20-100).
TOPK_SELECT_MAX = 4096


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    top_k_max: int = 0,
) -> torch.Tensor:
    """Masks (with -inf) tokens outside top-k, outside the top-p nucleus, or under
    ``min_p * max_prob``. ``top_k`` 0 and ``top_p`` 1 and ``min_p`` 0 disable per row.
    The most likely token is always kept; top-k keeps every token tied with the k-th, and
    top-p every token tied with the nucleus's least likely.

    ``top_k_max``: no row's top_k exceeds it (0: not known). Up to ``TOPK_SELECT_MAX`` the
    k-th largest logit comes from ``topk(top_k_max)`` instead of a full sort: the same
    value, so the same mask, without sorting every row's vocabulary."""
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        if 0 < top_k_max <= TOPK_SELECT_MAX and top_k_max < vocab:
            top = logits.topk(top_k_max, dim=-1).values  # [N, top_k_max], descending
            kth = top.gather(1, (k.clamp(max=top_k_max) - 1).unsqueeze(1))
            kth = torch.where((top_k > 0).unsqueeze(1), kth, float("-inf"))  # rows without
        else:
            kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p is not None or min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        if min_p is not None:
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits.masked_fill_(probs < threshold, float("-inf"))
        if top_p is not None:
            # the nucleus: the fewest most likely tokens whose mass reaches top_p, and
            # their ties (a radix select on CUDA: ``kvscale.kernels.top_p``)
            tau = ops.top_p_threshold(probs, top_p)
            logits.masked_fill_(probs < tau.unsqueeze(1), float("-inf"))
    return logits


def draw(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    default: torch.Generator | None,
) -> torch.Tensor:
    """Samples one token per row of ``probs [N, V]`` by the exponential race
    ``argmax(p / E)``, ``E ~ Exp(1)``. Rows with a generator draw their noise from it
    alone, so a seeded request's tokens do not depend on its batch neighbours."""
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_(generator=default)
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    return (probs / noise).argmax(dim=-1)


def target_distribution(
    logits: torch.Tensor,
    t: SamplingTensors,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What each row samples from: ``logits [N, V]`` fp32 (modified in place) after
    penalties, temperature and top-k/top-p/min-p. Returns ``(probs [N, V], or None when
    every row is greedy; greedy_tokens [N]``, the argmax after penalties)``."""
    if t.do_penalties:
        assert prompt_mask is not None and output_counts is not None
        apply_penalties(
            logits,
            prompt_mask,
            output_counts,
            t.repetition_penalty,
            t.presence_penalty,
            t.frequency_penalty,
        )
    greedy_tokens = ops.argmax(logits)
    if t.all_greedy:
        return None, greedy_tokens
    logits.div_(torch.where(t.greedy, 1.0, t.temperature).unsqueeze(1))
    apply_top_k_top_p_min_p(
        logits,
        t.top_k if t.do_top_k else None,
        t.top_p if t.do_top_p_min_p else None,
        t.min_p if t.do_top_p_min_p else None,
        t.top_k_max,
    )
    return torch.softmax(logits, dim=-1), greedy_tokens


def sample(
    logits: torch.Tensor,
    t: SamplingTensors,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits [N, V]`` fp32 (modified in place) -> sampled token ids ``[N]`` int64."""
    probs, greedy_tokens = target_distribution(logits, t, prompt_mask, output_counts)
    if probs is None:
        return greedy_tokens
    sampled = draw(probs, generators, default_generator)
    return torch.where(t.greedy, greedy_tokens, sampled)


def top_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the unmodified distribution.

    Returns ``(top_ids [N, k], top_lp [N, k], sampled_lp [N], sampled_rank [N])``;
    rank 1 is the most likely token.
    """
    lp = torch.log_softmax(raw_logits, dim=-1)
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], sampled[:, None][:, :0])
    sampled_lp = lp.gather(1, sampled.unsqueeze(1)).squeeze(1)
    rank = (lp > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
    return top_ids, top_lp, sampled_lp, rank


_MASK64 = (1 << 64) - 1


def row_seed(seed: int, index: int) -> int:
    """The seed of the draw for output token ``index`` (0-based) of a sequence seeded with
    ``seed``: splitmix64 of both, so every draw of a seeded sequence is fixed by the seed
    and the token's index alone, whatever step, batch or rank computes it. In [0, 2**63)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def seeded_generators(
    seeds: list[int | None], device: torch.device
) -> list[torch.Generator | None]:
    """A fresh generator per seeded row (``row_seed`` values), None for the others."""
    gens: list[torch.Generator | None] = []
    for s in seeds:
        if s is None:
            gens.append(None)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(s)
            gens.append(g)
    return gens
