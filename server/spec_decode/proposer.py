"""What every proposer of draft tokens gives the engine, and the interface it implements.

The engine asks for drafts once per step, for the running sequences that may speculate,
with their accepted tokens (prompt + output, all known on the host). A proposer returns up
to ``k`` tokens per sequence and, when it sampled them, the exact distribution each was
sampled from (``q``), so the rejection sampler keeps the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(slots=True)
class DraftRequest:
    """One sequence to draft for (read-only by convention: not frozen, because a frozen
    dataclass costs several times more to build, and a step builds one per sequence)."""

    seq_id: int
    # its accepted tokens: prompt + output (no placeholders). Accepted tokens are final:
    # between calls a sequence's list only grows (release a seq_id before reusing it),
    # which lets proposers update their state in O(new tokens)
    token_ids: Sequence[int]
    k: int  # drafts wanted, >= 1
    temperature: float = 0.0  # 0: greedy (a draft model proposes its argmax)
    seed: int | None = None  # a seeded request: the draft's sampling is seeded too


@dataclass
class Proposal:
    """Drafts of a batch of ``B`` requests, ``K = max k``.

    ``q_ids``/``q_probs`` ``[B, K, M]``: the support and probabilities (float32, summing to
    1 over M per drafted position, zero-padded) of the distribution each draft token was
    sampled from; None means point masses at the drafted tokens (n-gram lookup, greedy
    drafts)."""

    tokens: np.ndarray  # [B, K] int64, -1 past num_tokens
    num_tokens: np.ndarray  # [B] int64, 0..k of that request
    q_ids: np.ndarray | None = None
    q_probs: np.ndarray | None = None

    @staticmethod
    def empty(batch: int, k: int) -> Proposal:
        return Proposal(np.full((batch, k), -1, np.int64), np.zeros(batch, np.int64))


@dataclass
class DeviceProposal:
    """Drafts still on the device, as an in-process draft model leaves them before any
    sync: the host knows how many each request got, not which tokens. For ``B``
    requests, ``P`` rows that drafted and ``K`` = their most drafts:

    - ``num_tokens [B]`` int64 (host), ``rows [B]`` int64 (host): each request's row of
      the device tensors (-1: no drafts);
    - ``tokens [P, K]`` int64 (device; past a row's count: padding, never read);
    - ``q_ids [P, K, M]`` int64 / ``q_probs [P, K, M]`` float32 (device), or None: point
      masses (greedy drafts)."""

    num_tokens: np.ndarray
    rows: np.ndarray
    tokens: Any
    q_ids: Any = None
    q_probs: Any = None


class Proposer(Protocol):
    """N-gram lookup, or a draft model in process or in a sidecar."""

    name: str  # "ngram" or "draft"

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Drafts for each request (never raises for an unavailable draft: no drafts)."""
        ...

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forgets the state of sequences that finished or were preempted."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DeviceProposer(Protocol):
    """What a proposer on the target's device adds so that the target never waits for
    the drafts on the host: the engine builds the verify step around placeholders and
    the worker copies the drafts into its inputs on the device, in stream order after
    the draft model's work (``Worker._place_drafts``)."""

    def propose_on_device(self, requests: list[DraftRequest]) -> DeviceProposal:
        """``propose``'s drafts, left on the device; returns without waiting for them."""
        ...


@runtime_checkable
class VerifyFollower(Protocol):
    """What a proposer adds to draft the next step on the device, right after a verify
    step's rejection sampler (the device n-gram proposer): the engine stages the verify
    rows' sequences before the launch, the worker calls ``after_verify`` with the sampler's
    output, and the next ``propose`` finds the drafts ready."""

    def stage_verify(self, seq_ids: list[int]) -> None: ...

    def after_verify(self, tokens: Any, num_accepted: Any) -> None:
        """``tokens [N, K + 1]`` int64, ``num_accepted [N]``: device tensors, in the
        staged order; queue work on the current stream, never wait."""
        ...
