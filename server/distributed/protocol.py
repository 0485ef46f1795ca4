"""What rank 0 and the other ranks tell each other, over two one-way pipes per rank.

Steps pipe (rank 0 -> rank r): ``Init`` once, then each step's ``StepInput`` (pickled
once by the driver and written to every rank), then ``None`` to stop.
Status pipe (rank r -> rank 0): ``Joining`` before the process group is joined,
``Loaded`` once the rank's worker is built, ``Failed`` with the reason when the rank
gives up (it then exits non-zero).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.config import ResolvedConfig


@dataclass(frozen=True)
class Init:
    """Everything rank ``rank`` needs to start: the configuration, its rank, the
    rendezvous port of rank 0's store and the log level."""

    config: ResolvedConfig
    rank: int
    store_port: int
    log_level: str = "INFO"


@dataclass(frozen=True)
class Joining:
    rank: int
    pid: int


@dataclass(frozen=True)
class Loaded:
    rank: int
    num_kv_blocks: int


@dataclass(frozen=True)
class Failed:
    rank: int
    message: str
