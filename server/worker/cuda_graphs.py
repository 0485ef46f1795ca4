"""CUDA graphs for decode steps: captured at start-up, replayed with padding.

A decode step (one new token per sequence) runs the same kernels every time; only the
inputs change. For each batch size in ``batch_sizes`` the whole forward plus the LM
head is captured once, reading from static buffers (token ids, positions, slot mapping,
sequence lengths, block tables). A step of ``n`` sequences (its inputs already padded to
the graph's size ``bs`` and on the device) is copied into the first ``bs`` rows in one
launch (``kernels.decode_inputs``), which also replaces each placeholder id with the
token of ``last_tokens`` (the previous step's samples) it points at, and graph ``bs`` is
replayed; padding rows write nothing (slot -1) and attend to one token of block 0, and
their logits are dropped. Every graph writes its logits into the first rows of one
buffer (``logits_buf``, ``[max_batch, V]``): kept per graph, they were the graphs' largest
memory (~8.5 GB for 1,024 rows x 128,256 tokens in bf16 over 68 sizes, taken from the
headroom the KV pool leaves: an FP8 engine ran out of memory, NOTES "e86 measured").
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from kvscale.kernels.decode_inputs import load_decode_inputs
from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.forward_context import forward_context
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.quantization.dense import blas_for_capture

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        last_tokens: torch.Tensor,
    ) -> None:
        self.model = model
        self.backend = backend
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.last_tokens = last_tokens
        n, device = self.max_batch, last_tokens.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # views of logits_buf
        self.logits_buf: torch.Tensor | None = None

    def _meta(self, bs: int) -> AttentionMetadata:
        # max_seq_len is the table's capacity: it fixes the split-KV choice at capture.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
        )

    def _forward(self, bs: int, out: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids hold resolved tokens: run() resolves the placeholders as it copies
        with forward_context(self.backend, self._meta(bs)):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            return self.model.compute_logits(hidden, out)  # type: ignore[operator]

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Captures every batch size, largest first, sharing one memory pool (``pool``:
        a ``torch.cuda.graph_pool_handle()`` shared with other graphs; None: a new one)."""
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                with blas_for_capture(self.last_tokens.device, bs):
                    warm = self._forward(bs)  # warm-up: compiles kernels outside the capture
                    if self.logits_buf is None:  # the largest size comes first
                        self.logits_buf = warm.new_empty(self.max_batch, warm.shape[-1])
                    del warm
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.logits[bs] = self._forward(bs, self.logits_buf[:bs])
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.batch_sizes,
            time.perf_counter() - start,
        )

    def release(self) -> None:
        """Drops every captured graph (the engine is stopping: nothing replays them)."""
        self.graphs.clear()
        self.logits.clear()
        self.logits_buf = None

    def graph_size(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None if n is too large."""
        for bs in self.batch_sizes:
            if bs >= n:
                return bs
        return None

    def run(self, dev: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """Replays the graph for a decode step whose device inputs (``ids``, ``positions``,
        ``slots``, ``seq_lens`` [bs]; ``tables`` [bs, W]) are padded to a captured size
        ``bs``; returns the logits ``[n, V]`` (the model's dtype) of the real rows. Table
        columns past W keep stale entries: kernels never read past a row's length."""
        bs = dev["ids"].shape[0]
        load_decode_inputs(
            dev["ids"], dev["positions"], dev["slots"], dev["seq_lens"], dev["tables"],
            self.last_tokens,
            (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
             self.block_tables),
        )  # fmt: skip
        self.graphs[bs].replay()
        return self.logits[bs][:n]
