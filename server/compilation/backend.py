"""The Dynamo backend that compiles the model piecewise.

Flow (vLLM's and SGLang's piecewise backends, in our terms):

1. The worker compiles the model's forward once with ``torch.compile(backend=this,
   fullgraph=True)``, the token dimension of ``input_ids``/``positions`` marked dynamic
   and every guard dropped (so token counts of 1, 8 or 8192 reuse the one graph).
2. ``__call__`` gets Dynamo's FX graph (weights, KV caches and the token-count symbol
   are graph inputs), splits it at the split ops (``split.py``), and runs the split
   module once on fake tensors; each piece met on the way is compiled for the dynamic
   shape (``compiler.py``) and replaced by a ``CapturedPiece`` (``piece.py``).
3. The split module is what Dynamo then calls every step: pieces (compiled, captured
   per bucket) alternate with the split ops, which run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kvscale.server.compilation.compiler import PieceCompiler
from kvscale.server.compilation.config import CompilationConfig
from kvscale.server.compilation.direct_calls import direct_call
from kvscale.server.compilation.piece import CapturedPiece
from kvscale.server.compilation.split import SplitItem, op_target_name, split_graph

log = logging.getLogger(__name__)


def no_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's ``guard_filter_fn``: keep none. The one graph serves every call; what a
    guard would check (weights, KV-cache tensors, sizes) does not change after start-up."""
    return [False] * len(entries)


class _CompilePieces(fx.Interpreter):
    """Runs the split module on fake tensors, compiling each piece as it is reached."""

    def __init__(self, split_gm: fx.GraphModule, backend: PiecewiseBackend) -> None:
        super().__init__(split_gm)
        self.backend = backend
        self.piece_names = [it.name for it in backend.items if not it.is_split_op]

    def run(self, *args: Any) -> Any:  # type: ignore[override]
        from torch._dispatch.python import enable_python_dispatcher
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode()
        fake = [
            fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and fake_mode else a
            for a in args
        ]
        with fake_mode or torch.no_grad(), enable_python_dispatcher():
            return super().run(*fake)

    def call_module(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.piece_names:
            index = self.piece_names.index(target)
            gm = self.fetch_attr(target)
            be = self.backend
            general = be.compiler.compile(gm, args, index)
            piece = CapturedPiece(
                gm,
                general,
                index,
                len(self.piece_names),
                be.compiler,
                be.config.compile_sizes,
                be.pool,
                be.config.debug,
            )
            be.pieces.append(piece)
            self.module.__dict__[target] = piece  # found before the registered submodule
        return out


class PiecewiseBackend:
    """``torch.compile(model, backend=PiecewiseBackend(config, pool))``: splits the
    traced graph at ``config.split_ops`` and compiles the pieces with
    ``config.compiler``. ``pool``: the CUDA graphs' memory pool handle (None on CPU)."""

    def __init__(self, config: CompilationConfig, pool: Any = None) -> None:
        self.config = config
        self.pool = pool
        self.compiler = PieceCompiler(config.compiler, config.cache_dir)
        self.split_gm: fx.GraphModule | None = None
        self.items: list[SplitItem] = []
        self.pieces: list[CapturedPiece] = []
        self.seconds = 0.0  # splitting and compiling

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.split_gm is not None:
            raise RuntimeError(
                "the piecewise backend was asked to compile a second graph: the model "
                "must trace as one graph with no guards (fullgraph=True, no_guards)"
            )
        start = time.perf_counter()
        split_gm, self.items = split_graph(gm, self.config.split_op_targets)
        if not any(it.is_split_op for it in self.items):
            raise RuntimeError(
                f"no split op ({', '.join(self.config.split_ops)}) was found in the traced "
                "model: attention would be captured into the graphs"
            )
        self.split_gm = split_gm
        _CompilePieces(split_gm, self).run(*example_inputs)
        for it in self.items:
            if it.is_split_op:  # the op's code directly if registered, else its submodule
                op = next(filter(None, map(op_target_name, it.module.graph.nodes)), None)
                split_gm.__dict__[it.name] = direct_call(it.module, op) or it.module.forward
        if self.config.debug and self.config.cache_dir:
            self._dump(split_gm)
        self.seconds = time.perf_counter() - start
        return split_gm

    @property
    def num_split_ops(self) -> int:
        return sum(it.is_split_op for it in self.items)

    def _dump(self, split_gm: fx.GraphModule) -> None:
        path = Path(self.config.cache_dir or ".") / "split_graph.py"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(split_gm.print_readable(print_output=False))
            log.info("piecewise: split graph written to %s", path)
        except OSError as e:
            log.warning("piecewise: could not write %s (%s)", path, e)
