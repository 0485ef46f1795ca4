"""What the compiled pieces do in the current forward: the dispatcher's decision.

The worker sets it around each call of the compiled model; every piece reads it
(``current``) and trusts it, as vLLM's wrappers trust their forward context:

- ``bucket`` None: run each piece's dynamic-shape code directly (warm-up, steps above
  the largest bucket, a whole-model decode graph being captured around the pieces);
- ``bucket`` b, ``graphs`` False: run the code for size b without CUDA graphs (CPU, and
  the warm-up before a capture);
- ``bucket`` b, ``graphs`` True: replay the piece's graph for b, capturing it first if
  ``capture`` is set (start-up only: a step never captures).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class PieceRun:
    bucket: int | None = None
    graphs: bool = False
    capture: bool = False


_current = PieceRun()


def current() -> PieceRun:
    return _current


@contextmanager
def piece_run(bucket: int | None, graphs: bool = False, capture: bool = False) -> Iterator[None]:
    """Sets how the pieces run for one forward of the compiled model."""
    global _current
    prev, _current = _current, PieceRun(bucket, graphs, capture)
    try:
        yield
    finally:
        _current = prev
