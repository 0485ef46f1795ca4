"""Which graph runs a step: the one place that decides (pure, no torch).

- ``full``: a decode-only step (one new token per sequence) replays the whole-model
  decode graph of the smallest captured batch ``>= num_seqs`` (the driver pads its rows).
- ``piecewise``: any other step of at most the largest captured token count (mixed
  prefill+decode, a chunked prefill, a speculative verify step of ``k + 1`` tokens per
  sequence, or a decode step too large for the decode graphs) replays the piecewise
  graphs of the smallest token bucket ``>= num_tokens``.
- ``eager``: everything else.

``--cuda-graph-mode`` chooses which of the first two exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.compilation.config import bucket_for


@dataclass(frozen=True)
class Dispatch:
    kind: str  # "full" | "piecewise" | "eager"
    size: int  # full: padded sequences; piecewise: padded tokens; eager: 0


EAGER = Dispatch("eager", 0)


@dataclass(frozen=True)
class GraphDispatcher:
    """``decode_sizes``: captured decode batch sizes; ``token_sizes``: captured
    piecewise token buckets (both ascending; empty: none of that kind)."""

    decode_sizes: tuple[int, ...] = ()
    token_sizes: tuple[int, ...] = ()

    def decode_size(self, num_seqs: int) -> int:
        """The decode graph a decode-only step of ``num_seqs`` rows replays (0: none)."""
        return bucket_for(self.decode_sizes, num_seqs) or 0

    def dispatch(self, num_tokens: int, decode_graph_size: int = 0) -> Dispatch:
        """The graph for a step of ``num_tokens`` new tokens; ``decode_graph_size`` is the
        decode graph the driver padded the step for (0: none)."""
        if decode_graph_size:
            return Dispatch("full", decode_graph_size)
        bucket = bucket_for(self.token_sizes, num_tokens)
        if bucket is not None:
            return Dispatch("piecewise", bucket)
        return EAGER
