"""Piecewise CUDA graphs for mixed steps: the worker's side.

The model's forward is compiled once (``server/compilation``): Dynamo traces it with the
token dimension dynamic, the piecewise backend splits it at attention and compiles each
piece. At start-up each token bucket is warmed up and then captured, largest first, all
pieces into one memory pool. A step of ``n`` tokens runs as the bucket ``b >= n``:

- its token ids (placeholders resolved) and positions are copied into the first ``n``
  rows of static buffers, whose ``b``-row prefix the first piece was captured reading;
  rows ``n..b`` keep stale but valid ids and positions;
- its attention metadata is copied into static buffers as well (``slot_mapping`` has
  ``n`` entries: attention computes and writes only the real tokens, the padding rows
  write no KV and their attention output stays 0);
- the pieces replay, attention runs eagerly between them, and only the rows that sample
  (all ``< n``) reach the LM head.

On CPU nothing is captured: the same code pads to the same buckets and runs each
piece's compiled code, which is what the CPU tests check against eager execution.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.forward_context import forward_context
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.compilation.backend import PiecewiseBackend, no_guards
from kvscale.server.compilation.config import CompilationConfig
from kvscale.server.compilation.runtime import piece_run
from kvscale.server.worker.step import StepInput, resolve_placeholders

log = logging.getLogger(__name__)


def own_forward(module: nn.Module) -> None:
    """Gives ``module`` a ``forward`` with a code object of its own (its class's, copied).

    Dynamo keeps compiled entries, the recompile count and its decision to stop compiling
    per code object, and the model class's ``forward`` is shared by every engine in the
    process (``--compile``'s whole-model graphs too). Sharing it, each piecewise engine
    adds a guard-free entry; a later one past ``recompile_limit`` is refused; and once any
    compile of that code hits the limit, Dynamo only runs it (eagerly when no entry
    matches) from then on: the piecewise backend is never called, and before torch 2.12
    no error says so, so padded buckets ran through the uncompiled model."""
    fn = type(module).forward
    if not isinstance(fn, types.FunctionType):
        return
    own = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    own.__kwdefaults__ = fn.__kwdefaults__
    own.__qualname__ = fn.__qualname__
    module.forward = types.MethodType(own, module)  # type: ignore[method-assign]


class PiecewiseGraphs:
    """The compiled model, its static inputs and (on CUDA) its per-bucket graphs.

    ``model``: the causal LM (``model.model`` is compiled, ``compute_logits`` eager);
    ``max_seqs``/``max_blocks_per_seq``: sizes of the static metadata buffers;
    ``last_tokens``: the previous step's samples that placeholder ids point at;
    ``pool``: the CUDA graph memory pool shared with the decode graphs (None on CPU)."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        config: CompilationConfig,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        last_tokens: torch.Tensor,
        pool: Any = None,
    ) -> None:
        self.model = model
        self.attn_backend = backend
        self.config = config
        self.block_size = block_size
        self.last_tokens = last_tokens
        self.device = device = last_tokens.device
        self.use_graphs = device.type == "cuda"
        self.compile_backend = PiecewiseBackend(config, pool if self.use_graphs else None)
        own_forward(model.model)  # type: ignore[arg-type]
        self.compiled = torch.compile(
            model.model,  # type: ignore[arg-type]
            backend=self.compile_backend,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": no_guards},
        )
        n = max(2, config.max_capture_size)  # tracing needs >= 2 tokens (see compile)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        # the side stream captures run on (cuBLAS allocates a workspace per stream)
        self.capture_stream = torch.cuda.Stream(device) if self.use_graphs else None
        self.compile_seconds = 0.0
        self.capture_seconds = 0.0

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.config.capture_sizes

    # ---- start-up -----------------------------------------------------------------------
    def _dummy_meta(self, n: int) -> AttentionMetadata:
        """One sequence of ``n`` tokens that writes nothing (slots -1) and attends over
        block 0: valid inputs for the eager attention while compiling and capturing
        (attention is not captured, so these need not be the static buffers)."""
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
            query_start_loc=torch.arange(0, 2 * n, n, dtype=torch.int32, device=dev),
            seq_lens=torch.full((1,), n, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, -(-n // self.block_size), dtype=torch.int32, device=dev),
            max_query_len=n,
            max_seq_len=n,
        )

    def _forward(self, n: int, bucket: int | None, **run: bool) -> torch.Tensor:
        with piece_run(bucket, **run), forward_context(self.attn_backend, self._dummy_meta(n)):
            return self.compiled(self.input_ids[:n], self.positions[:n])  # type: ignore[no-any-return]

    @torch.inference_mode()
    def compile(self) -> None:
        """Traces the model (the token dimension dynamic) and compiles every piece."""
        n = self.input_ids.shape[0]  # >= 2: Dynamo specializes sizes 0 and 1
        torch._dynamo.mark_dynamic(ids := self.input_ids[:n], 0)
        torch._dynamo.mark_dynamic(pos := self.positions[:n], 0)
        start = time.perf_counter()
        with piece_run(None), forward_context(self.attn_backend, self._dummy_meta(n)):
            self.compiled(ids, pos)
        self.compile_seconds = time.perf_counter() - start
        be = self.compile_backend
        if be.split_gm is None:
            # Dynamo ran the forward without compiling it (compiling disabled, or given
            # up for this code); nothing would be captured, and padded buckets would run
            # through the uncompiled model, whose attention takes no padding rows.
            raise RuntimeError(
                "torch.compile ran the model eagerly: the piecewise backend was never "
                "called (TORCH_COMPILE_DISABLE, a compiler stance, or Dynamo's recompile "
                "limit for the model's forward)"
            )
        st = be.compiler.stats
        log.info(
            "piecewise: traced and split the model into %d pieces around %d attention ops; "
            "%s pieces: %d compiled, %d loaded from the cache, %d shared; %.1f s",
            len(be.pieces),
            be.num_split_ops,
            self.config.compiler,
            st.compiled,
            st.loaded,
            st.reused,
            self.compile_seconds,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up and captures every bucket, largest first. On CPU nothing is captured:
        only the static-shape pieces of ``compile_sizes`` are compiled now, not mid-step."""
        if not self.use_graphs:
            for b in self.config.compile_sizes:
                self._forward(b, b)
            return
        start = time.perf_counter()
        stream = self.capture_stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.capture_all(torch.cuda.synchronize)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "piecewise: captured %d token sizes (%d..%d) x %d pieces in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            len(self.compile_backend.pieces),
            self.capture_seconds,
        )

    def capture_all(self, sync: Callable[[], None] = lambda: None) -> None:
        """Each bucket, largest first: a warm-up forward (compiling kernels, and the
        static-shape pieces of ``compile_sizes``), ``sync()``, then a capturing one."""
        for b in reversed(self.sizes):
            self._forward(b, b)
            sync()  # as torch.cuda.graph does before capturing
            self._forward(b, b, graphs=True, capture=True)

    def release(self) -> None:
        """Drops every piece's captured graphs (the engine is stopping)."""
        for piece in self.compile_backend.pieces:
            piece.drop_graphs()

    # ---- one step -----------------------------------------------------------------------
    def run(self, step: StepInput, dev: dict[str, torch.Tensor], bucket: int) -> torch.Tensor:
        """The step (``n <= bucket`` tokens of ``B`` sequences, unpadded device inputs)
        through the pieces of ``bucket``; logits ``[S, V]`` (the model's dtype) of its
        sampling rows."""
        n, b = step.num_tokens, step.num_seqs
        width = dev["tables"].shape[1]
        self.input_ids[:n].copy_(resolve_placeholders(dev["ids"], self.last_tokens))
        self.positions[:n].copy_(dev["positions"])
        self.slot_mapping[:n].copy_(dev["slots"])
        self.query_start_loc[: b + 1].copy_(dev["q_start"])
        self.seq_lens[:b].copy_(dev["seq_lens"])
        self.block_tables[:b, :width].copy_(dev["tables"])
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b, :width],
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        with piece_run(bucket, graphs=self.use_graphs), forward_context(self.attn_backend, meta):
            hidden = self.compiled(self.input_ids[:bucket], self.positions[:bucket])
        return self.model.compute_logits(hidden[dev["logits_idx"]])  # type: ignore[operator]
