"""Rejection sampling of drafted tokens against the target model (Leviathan et al. 2023,
Chen et al. 2023): the emitted tokens are distributed exactly as the target's.

Pure batched torch, no engine state. One row per speculating sequence; row ``i`` verifies
``num_draft[i] <= K`` drafted tokens against the target's probabilities at ``K + 1``
positions (the last one is the bonus position). Rows that draft fewer than ``K`` tokens
are padded; padding is never read.

* Greedy rows accept a drafted token only if it is the target's argmax at its position,
  and emit the target's argmax at the first mismatch (or at the bonus position): exactly
  the tokens greedy decoding without speculation would give.
* Sampling rows accept drafted token ``x`` at position ``j`` with probability
  ``min(1, p_j(x) / q_j(x))``; on the first rejection they draw from
  ``normalize(max(0, p_j - q_j))``; when all are accepted they draw a bonus token from
  ``p_K``. ``q`` must be exactly the distribution the draft sampled from; ``draft_probs``
  None means a point mass at the drafted token (the n-gram proposer), where acceptance is
  ``p_j(x)`` and the residual is ``p_j`` with ``x`` removed.

Randomness: rows with their own generator (a seeded request) draw all their noise from it
in a fixed order (``K`` uniforms, then one ``Exp(1)`` vector of the vocabulary's size), so
the result depends only on the generator's seed, the inputs and nothing else in the batch;
the other rows share ``default``. Seed a row's generator with
``row_seed(seed, num_output_tokens)`` (as the normal sampler does per token index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = -1


@dataclass
class RejectionOutput:
    tokens: torch.Tensor  # [N, K + 1] int64: accepted drafts then one target token, PAD after
    num_accepted: torch.Tensor  # [N] int64: drafted tokens accepted (emitted = this + 1)
    accepted_mask: torch.Tensor  # [N, K] bool: position j accepted (for per-position metrics)


def _noise(
    n: int,
    k: int,
    vocab: int,
    generators: list[torch.Generator | None],
    default: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    uniform = torch.empty(n, k, device=device)
    expo = torch.empty(n, vocab, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < n:
        uniform.uniform_(generator=default)
        expo.exponential_(generator=default)
    for i in seeded:
        uniform[i].uniform_(generator=generators[i])
        expo[i].exponential_(generator=generators[i])
    return uniform, expo


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    greedy: torch.Tensor,
    generators: list[torch.Generator | None] | None = None,
    default: torch.Generator | None = None,
    draft_probs: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verifies drafts.

    ``target_probs [N, K+1, V]`` fp32: the target's distribution at each position after
    the request's penalties, temperature, top-k/top-p/min-p (rows of greedy sequences may
    hold anything whose argmax is the greedy token, or pass ``target_argmax``).
    ``draft_tokens [N, K]`` int64 (padding beyond ``num_draft`` ignored), ``num_draft
    [N]`` int64 in ``[0, K]``, ``greedy [N]`` bool. ``draft_probs [N, K, V]`` or None
    (point mass at the drafted token). ``target_argmax [N, K+1]``: the greedy tokens
    (defaults to ``target_probs.argmax(-1)``); pass the argmax of the penalised logits to
    match greedy sampling bit for bit when probabilities tie.
    """
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    assert draft_tokens.shape == (n, k), (draft_tokens.shape, (n, k))
    device = target_probs.device
    if generators is None:
        generators = [None] * n
    positions = torch.arange(k, device=device)
    valid = positions.unsqueeze(0) < num_draft.unsqueeze(1)  # [N, K]
    drafts = torch.where(valid, draft_tokens, 0)
    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)

    uniform, expo = _noise(n, k, vocab, generators, default, device)
    p_draft = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [N, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
    # u < p / q without dividing (q > 0 for a token the draft sampled): min(1, p/q) holds
    # because u < 1
    sampled_accept = uniform * q_draft < p_draft
    greedy_accept = drafts == target_argmax[:, :k]
    accept = torch.where(greedy.unsqueeze(1), greedy_accept, sampled_accept) & valid
    accepted_mask = torch.cumprod(accept.to(torch.int64), dim=1).bool()
    num_accepted = accepted_mask.sum(dim=1)  # [N]

    # the distribution of the token emitted at position num_accepted
    idx = num_accepted.view(n, 1, 1).expand(n, 1, vocab)
    p_at = target_probs.gather(1, idx).squeeze(1)  # [N, V]
    rejected = num_accepted < num_draft  # else: bonus token from p at position num_draft
    if draft_probs is None:
        tok_at = drafts.gather(1, num_accepted.clamp(max=max(k - 1, 0)).unsqueeze(1)) if k else None
        residual = p_at.clone()
        if tok_at is not None:
            residual.scatter_(1, tok_at, 0.0)
    else:
        q_idx = num_accepted.clamp(max=max(k - 1, 0)).view(n, 1, 1).expand(n, 1, vocab)
        q_at = draft_probs.gather(1, q_idx).squeeze(1)
        residual = (p_at - q_at).clamp_(min=0.0)
    mass = residual.sum(dim=1, keepdim=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0, but rounding
    # can still reject: fall back to p
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
    final_dist = torch.where(rejected.unsqueeze(1), residual, p_at)
    sampled_final = (final_dist / expo).argmax(dim=-1)
    greedy_final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    final = torch.where(greedy, greedy_final, sampled_final)

    tokens = torch.full((n, k1), PAD, dtype=torch.int64, device=device)
    tokens[:, :k] = torch.where(accepted_mask, drafts, PAD)
    tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return RejectionOutput(tokens=tokens, num_accepted=num_accepted, accepted_mask=accepted_mask)


def greedy_verify(
    draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_argmax: torch.Tensor
) -> RejectionOutput:
    """``rejection_sample`` when every row is greedy, without probabilities or noise: the
    drafts accepted are the leading ones equal to the target's argmax, and the token after
    them is the argmax at that position, so the emitted tokens are ``target_argmax``'s
    first ``num_accepted + 1`` (PAD after). Shapes as ``rejection_sample``'s."""
    k1 = target_argmax.shape[1]
    k = k1 - 1
    valid = torch.arange(k, device=draft_tokens.device).unsqueeze(0) < num_draft.unsqueeze(1)
    accept = (draft_tokens == target_argmax[:, :k]) & valid
    accepted_mask = torch.cumprod(accept.to(torch.int64), dim=1).bool()
    num_accepted = accepted_mask.sum(dim=1)
    emitted = torch.arange(k1, device=draft_tokens.device).unsqueeze(0) <= num_accepted.unsqueeze(1)
    tokens = torch.where(emitted, target_argmax, PAD)
    return RejectionOutput(tokens=tokens, num_accepted=num_accepted, accepted_mask=accepted_mask)
