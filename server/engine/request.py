"""A request as the engine core holds it (one sequence per sample), and the one check
every request passes before it is queued."""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.engine.sequence import Sequence
from kvscale.server.errors import InvalidRequestError
from kvscale.server.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def validate_request(
    prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """The one check every request passes at the engine's edge (``AsyncEngine.submit``,
    ``LLMEngine.add_request``) before it is queued. Raises InvalidRequestError naming the
    field; SamplingParams validated its own values on construction."""
    if not isinstance(prompt_ids, list) or not prompt_ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}",
            param="prompt",
        )
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(prompt_ids)} tokens, but max_model_len is "
            f"{max_model_len}; the prompt must be shorter to leave room for output",
            param="prompt",
            code="context_length_exceeded",
        )
    bad_stop = [t for t in params.stop_token_ids or () if t >= vocab_size]
    if bad_stop:
        raise InvalidRequestError(
            f"stop_token_ids must be < vocab size {vocab_size}; got {bad_stop}",
            param="stop_token_ids",
        )
    bad_bias = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad_bias:
        raise InvalidRequestError(
            f"logit_bias token ids must be < vocab size {vocab_size}; got {bad_bias[:5]}",
            param="logit_bias",
        )
