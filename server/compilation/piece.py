"""One piece of the split model: its compiled code and its CUDA graph per bucket.

The stitching module calls each piece in turn and the split ops (attention) between
them. A piece does what the current ``runtime.PieceRun`` says: run its dynamic-shape
code, run its code for the bucket (compiling it for that static shape first when the
bucket is in ``compile_sizes``), capture that code as a CUDA graph into the shared pool,
or replay the graph. A replay reads its inputs from the addresses seen at capture (the
worker's static input buffers, the weights, the previous piece's outputs, the attention
output buffer) and returns views of the addresses it writes (``weak_ref``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from kvscale.server.compilation import runtime
from kvscale.server.compilation.compiler import PieceCompiler
from kvscale.server.compilation.weak_ref import weak_refs


class CudaGraph:
    """One CUDA graph captured into the shared pool (``pool``: a graph pool handle)."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Captures ``fn()`` on the current stream, which must not be the default one."""
        self.graph.capture_begin(pool=self.pool)
        try:
            return fn()
        finally:
            self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Entry:
    """One bucket of one piece."""

    runnable: Callable[..., Any] | None = None
    graph: Any = None  # a CudaGraph (or what ``graph_factory`` makes)
    output: Any = None  # views of the graph's outputs (not owning them)
    input_addresses: list[int] = field(default_factory=list)


def _addresses(args: tuple[Any, ...]) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


class CapturedPiece:
    """Callable standing in for piece ``index`` of ``num_pieces`` in the split module."""

    def __init__(
        self,
        gm: fx.GraphModule,
        general: Callable[..., Any],
        index: int,
        num_pieces: int,
        compiler: PieceCompiler,
        compile_sizes: tuple[int, ...],
        pool: Any,
        debug: bool,
    ) -> None:
        self.gm = gm
        self.general = general  # compiled for the dynamic token dimension
        self.index = index
        self.is_last = index == num_pieces - 1
        self.compiler = compiler
        self.compile_sizes = frozenset(compile_sizes)
        self.pool = pool  # the CUDA graphs' shared memory pool (None: never captured)
        self.debug = debug
        self.entries: dict[int, _Entry] = {}
        # makes the graph of a capture; tests swap in one that records and re-runs
        self.graph_factory: Callable[[], Any] = lambda: CudaGraph(self.pool)

    def drop_graphs(self) -> None:
        """Drops this piece's captured graphs; a later run of a bucket captures again."""
        for entry in self.entries.values():
            entry.graph = entry.output = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(b for b, e in self.entries.items() if e.graph is not None)

    def __call__(self, *args: Any) -> Any:
        run = runtime.current()
        if run.bucket is None:
            return self.general(*args)
        entry = self.entries.get(run.bucket)
        if entry is None:
            entry = self.entries[run.bucket] = _Entry()
        if entry.runnable is None:
            entry.runnable = self.general
            if run.bucket in self.compile_sizes:
                entry.runnable = self.compiler.compile(self.gm, args, self.index, run.bucket)
        if not run.graphs:
            return entry.runnable(*args)
        if entry.graph is None:
            if not run.capture:
                raise RuntimeError(
                    f"piece {self.index}: no CUDA graph was captured for {run.bucket} tokens "
                    "(the dispatcher chose a size that start-up did not capture)"
                )
            return self._capture(entry, args)
        if self.debug:
            got = _addresses(args)
            if got != entry.input_addresses:
                raise RuntimeError(
                    f"piece {self.index}, {run.bucket} tokens: inputs moved since capture "
                    f"({entry.input_addresses} -> {got}); the replay would read stale memory"
                )
        entry.graph.replay()
        return entry.output

    def _capture(self, entry: _Entry, args: tuple[Any, ...]) -> Any:
        """Captures ``entry.runnable`` on the current (side) stream into the pool."""
        runnable = entry.runnable
        assert runnable is not None
        graph = self.graph_factory()
        entry.input_addresses = _addresses(args)
        out = graph.capture(lambda: runnable(*args))
        entry.output = weak_refs(out)
        entry.graph = graph
        if self.is_last:
            # Nothing captured later reads the last output: its memory goes back to the
            # pool now (a step reads it right after the replay, before any other replay).
            return entry.output
        # The owning tensors keep the memory allocated until the pieces still to be
        # captured in this forward have read them; then the pool may reuse it.
        return out
