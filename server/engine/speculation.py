"""The engine's side of speculative decoding: who drafts, how many tokens, and what the
verification of each step accepted.

Each speculative step (``EngineCore._spec_step``) asks the ``Speculator`` to draft for the
running sequences that may speculate, the scheduler feeds each one's last token plus its
drafts (``1 + d`` tokens), the worker verifies them (``Worker._verify``: exact rejection
sampling against the target's distribution at every position), and the engine emits the
``a`` accepted drafts plus one token of the target's and rolls the KV of the ``d - a``
rejected positions back (``record`` says how the sequence's ``k`` adapts).

Who speculates (``may_draft``): a decoding sequence (its prompt fully computed) whose
tokens are all known, with no grammar, no logprobs (sampled or prompt), no logit bias and
no pending ``min_tokens`` ban; the verify path applies temperature, top-k, top-p, min-p and
the repetition/presence/frequency penalties exactly as normal sampling does.

How many (``adapt``): ``k`` starts at ``num_speculative_tokens``; after each verify it
becomes the accepted count + 1 (all accepted: one more, up to the maximum), so a
sequence whose drafts keep failing drafts one token at a time. A sequence whose moving
acceptance rate falls under ``PAUSE_BELOW`` stops drafting for ``PAUSE_STEPS`` steps,
then tries again with one token. A proposal with no drafts (n-gram: no suffix matched;
a sidecar that is down) pauses the sequence for 1, 2, 4, ... up to ``MISS_PAUSE_MAX``
steps, doubling with each empty proposal in a row. Globally, speculation pauses while
more than ``speculative_disable_by_batch_size`` sequences run: a large batch is compute
bound and verifying ``k`` extra tokens per sequence costs more than the steps it saves.

A step speculates (unpipelined, see ``engine_core``) only when some running sequence
may draft in it (``Speculator.ready``); otherwise the engine runs its normal, pipelined
step, so paused sequences, prefills and requests that cannot speculate (logprobs,
grammars) cost nothing beyond the proposals actually made.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.engine.sequence import Sequence, SequenceStatus
from kvscale.server.spec_decode.proposer import (
    DeviceProposal,
    DeviceProposer,
    DraftRequest,
    Proposer,
    VerifyFollower,
)

PAUSE_BELOW = 0.15  # moving acceptance rate under which a sequence pauses drafting
PAUSE_STEPS = 16
MISS_PAUSE_MAX = 64  # longest pause after proposals with no drafts (steps)
EMA = 0.3  # weight of the newest verify in the moving acceptance rate


@dataclass
class SpecStats:
    """Cumulative counters, named as vLLM's ``spec_decode`` metrics."""

    num_drafts: int = 0  # verify rows (sequences x steps that drafted)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: accepted at position j

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify row (accepted drafts + the target's token)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def may_draft(seq: Sequence, max_model_len: int) -> int:
    """How many drafts ``seq`` may take now (0: it cannot speculate this step)."""
    p = seq.params
    if (
        seq.status is not SequenceStatus.RUNNING
        or seq.stopping
        or seq.num_computed_tokens != seq.num_tokens - 1
        or seq.grammar is not None
        or p.logprobs is not None
        or seq.prompt_lps is not None
        or p.logit_bias
        or seq.num_output_tokens < p.min_tokens
        or seq.spec_pause > 0
    ):
        return 0
    room = max_model_len - seq.num_tokens - 1  # the emitted tokens must fit the context
    if p.max_tokens is not None:
        room = min(room, p.max_tokens - seq.num_output_tokens - 1)
    return max(0, min(seq.spec_k, room))


def adapt(seq: Sequence, drafted: int, accepted: int, k_max: int) -> None:
    """Updates ``seq``'s next ``k``, moving acceptance rate and pause after a verify of
    ``drafted`` tokens of which ``accepted`` were accepted."""
    if drafted <= 0:
        return
    seq.spec_acceptance = (1 - EMA) * seq.spec_acceptance + EMA * accepted / drafted
    seq.spec_k = min(k_max, accepted + 1 + (accepted == drafted))
    if seq.spec_acceptance < PAUSE_BELOW:
        seq.spec_pause = PAUSE_STEPS
        seq.spec_k = 1
        seq.spec_acceptance = 0.5  # a fresh start once the pause is over


class Speculator:
    """Drafts for the running sequences through a ``Proposer``; counts what verification
    accepted."""

    def __init__(
        self,
        proposer: Proposer,
        k: int,
        disable_by_batch_size: int,
        single_rank: bool = True,
    ) -> None:
        """``single_rank``: the target runs on one rank (drafts may then stay on the
        device; other tensor-parallel ranks receive the step's host arrays only)."""
        self.proposer = proposer
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecStats(accepted_per_pos=[0] * k)
        self.propose_s = 0.0  # wall time in the proposer's host calls (seconds, cumulative)
        # the proposer drafts right after a verify step, on the device
        self.follows_verify = isinstance(proposer, VerifyFollower)
        # drafts left on the device for the verify step (an in-process draft model)
        self.on_device = single_rank and isinstance(proposer, DeviceProposer)
        self.device_drafts: DeviceProposal | None = None  # this step's, when on_device

    def active(self, num_running: int) -> bool:
        """Whether this step speculates (the batch is small enough)."""
        return num_running <= self.disable_by_batch_size

    def ready(self, running: list[Sequence], max_model_len: int) -> bool:
        """Whether this step speculates: the batch is small enough and some running
        sequence may draft. Called once a step: counts the paused sequences' pauses down."""
        if not self.active(len(running)):
            return False
        ready = False
        for seq in running:
            if seq.spec_pause > 0:
                seq.spec_pause -= 1
                continue
            if seq.spec_k == 0:
                seq.spec_k = self.k  # first time
            ready = ready or may_draft(seq, max_model_len) > 0
        return ready

    def draft(self, running: Iterable[Sequence], max_model_len: int) -> None:
        """Sets ``draft_tokens``/``draft_q`` of each running sequence (empty for those
        that do not speculate this step), after ``ready`` said this step speculates.
        With ``on_device``, the values stay on the device: ``draft_tokens`` holds
        placeholders (0) and ``draft_src`` where the sequence's drafts start in the
        flattened ``device_drafts.tokens``, which the worker copies into the step."""
        self.device_drafts = None
        seqs: list[Sequence] = []
        requests: list[DraftRequest] = []
        for seq in running:
            seq.draft_tokens = []
            seq.draft_q = None
            seq.draft_src = -1
            k = may_draft(seq, max_model_len)
            if k <= 0:
                continue
            p = seq.params
            seqs.append(seq)
            requests.append(
                DraftRequest(
                    seq.seq_id, seq.token_ids, k, 0.0 if p.greedy else p.temperature, p.seed
                )
            )
        if not requests:
            return
        t0 = time.perf_counter()
        if self.on_device:
            dp = self.device_drafts = self.proposer.propose_on_device(requests)  # type: ignore[attr-defined]
            self.propose_s += time.perf_counter() - t0
            width = dp.tokens.shape[1]
            for seq, d, row in zip(seqs, dp.num_tokens.tolist(), dp.rows.tolist(), strict=True):
                if self._drafted(seq, d):
                    seq.draft_tokens = [0] * d
                    seq.draft_src = row * width
            return
        out = self.proposer.propose(requests)
        self.propose_s += time.perf_counter() - t0
        for i, seq in enumerate(seqs):
            d = int(out.num_tokens[i])
            if not self._drafted(seq, d):
                continue
            seq.draft_tokens = out.tokens[i, :d].tolist()
            if out.q_ids is not None and out.q_probs is not None:
                seq.draft_q = (out.q_ids[i, :d], out.q_probs[i, :d])

    @staticmethod
    def _drafted(seq: Sequence, d: int) -> bool:
        """Whether ``seq`` got drafts (``d`` > 0); an empty proposal pauses it for 1, 2,
        4, ... steps, doubling with each one in a row."""
        if d <= 0:
            seq.spec_misses += 1
            seq.spec_pause = min(MISS_PAUSE_MAX, 1 << min(seq.spec_misses - 1, 30))
            return False
        seq.spec_misses = 0
        return True

    def stage(self, verifying: list[Sequence]) -> None:
        """Before a verify step is launched (``follows_verify`` only): its verify rows'
        sequences, in row order, for the proposer to draft the next step right after the
        rejection sampler, on the device (``after_verify``, the worker's verify hook)."""
        t0 = time.perf_counter()
        self.proposer.stage_verify([seq.seq_id for seq in verifying])  # type: ignore[attr-defined]
        self.propose_s += time.perf_counter() - t0

    def after_verify(self, tokens: Any, num_accepted: Any) -> None:
        """The worker's verify hook (device tensors: the rejection sampler's output)."""
        t0 = time.perf_counter()
        self.proposer.after_verify(tokens, num_accepted)  # type: ignore[attr-defined]
        self.propose_s += time.perf_counter() - t0

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Counts one verify row and adapts the sequence's ``k``."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_pos[j] += 1
        adapt(seq, drafted, accepted, self.k)

    def release(self, seq_ids: Iterable[int]) -> None:
        self.proposer.release(seq_ids)

    def close(self) -> None:
        self.proposer.close()
