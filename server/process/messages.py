"""Every message that crosses the pipes between the API process and the engine process.

Commands go to the engine; reports come back. Each is a small frozen dataclass with
slots (pickled by ``frames``); receivers dispatch on the class with ``match``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscale.server.engine.core_outputs import EngineStats, SeqUpdate
from kvscale.server.sampling_params import SamplingParams

# ---- to the engine process --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue ``params.n`` sequences of a prompt the API process already validated."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() in the API process (same host clock)
    cache_salt: str | None = None  # only requests with equal salts share cached blocks


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class FinishSequence:
    """A stop string (found on the API side) ended sample ``index`` of a request."""

    request_id: str
    index: int


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Forget every cached block hash (benchmarks start cold)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | FinishSequence | ResetPrefixCache | Shutdown

# ---- from the engine process ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """Sent once, after the model loaded. ``info``: architecture, device, dtype, KV blocks."""

    info: dict[str, Any]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """Sent once instead of ``Ready``; the process then exits."""

    message: str


@dataclass(frozen=True, slots=True)
class StepDone:
    """One step's token updates. ``added``: sequences queued since the last report."""

    updates: list[SeqUpdate]
    stats: EngineStats
    time: float
    added: int


@dataclass(frozen=True, slots=True)
class Idle:
    """The heartbeat of an idle engine (about once a second)."""

    stats: EngineStats
    time: float
    added: int


@dataclass(frozen=True, slots=True)
class Fatal:
    """The engine cannot go on (a tensor-parallel rank died or hangs); the process exits
    non-zero right after sending it. Sent instead of ``Ready`` when it happens while
    loading."""

    message: str


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A step raised; these requests were dropped."""

    request_ids: list[str]
    message: str


@dataclass(frozen=True, slots=True)
class Refused:
    """An ``AddRequest`` the engine could not queue."""

    request_id: str
    message: str


Report = Ready | LoadFailed | StepDone | Idle | StepFailed | Refused | Fatal

__all__ = [
    "AbortRequest",
    "AddRequest",
    "Command",
    "Fatal",
    "FinishSequence",
    "Idle",
    "LoadFailed",
    "Ready",
    "Refused",
    "Report",
    "ResetPrefixCache",
    "Shutdown",
    "StepDone",
    "StepFailed",
]
