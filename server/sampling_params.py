"""Per-request sampling settings, validated on construction (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvscale.server.errors import InvalidRequestError
from kvscale.server.structured.params import StructuredOutputsParams

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value (both signs)
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs; also logprobs and prompt_logprobs


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. ``top_k`` 0 or -1 disables top-k. ``stop`` strings are
    not included in the returned text. ``logprobs`` = k returns the top-k log
    probabilities (of the unmodified model distribution) plus the sampled token's.
    ``seed`` makes this request's sampling reproducible whatever else is batched with it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(f"{name} must be {allowed}, got {value!r}", param=name)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and v == v

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not is_num(self.temperature) or not 0 <= self.temperature <= 100:
            raise bad("temperature", "a number in [0, 100]")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 or -1 to disable")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "a number in (0, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "a number in [-2, 2]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}",
                param="min_tokens",
            )
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "true or false")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "a StructuredOutputsParams or None")
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "a mapping of token id to bias")
            for tok, bias in self.logit_bias.items():
                if not is_int(tok) or tok < 0:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids (integers >= 0), got {tok!r}",
                        param="logit_bias",
                    )
                if not is_num(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise InvalidRequestError(
                        f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                        f"for token {tok}",
                        param="logit_bias",
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_child(self, index: int) -> SamplingParams:
        """The settings of the ``index``-th of ``n`` samples (seeds offset by the index)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
