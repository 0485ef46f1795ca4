"""Runs one scheduled batch through the model and samples the next tokens.

Owns the model, the paged KV pool (allocated once) and the attention backend. Input
is the scheduler's batch; output is one sampled token (plus logprobs if asked) for
each sequence whose prompt is fully in the cache after this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvscale.server.attention.backend import get_backend
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.engine.cuda_graphs import DecodeGraphs, capture_sizes
from kvscale.server.engine.scheduler import ScheduledBatch
from kvscale.server.engine.sequence import Sequence
from kvscale.server.forward_context import forward_context
from kvscale.server.layers import ops
from kvscale.server.layers.sampler import SamplingTensors, sample, top_logprobs
from kvscale.server.loader import load_model
from kvscale.server.model_config import ModelConfig

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU when num_kv_blocks is not given


@dataclass
class StepResult:
    """For each sequence that sampled (in batch order): its token and optional logprobs."""

    seqs: list[Sequence]
    token_ids: list[int]
    # per row: (top ids, top logprobs, sampled logprob, sampled rank) when logprobs asked
    logprobs: list[tuple[list[int], list[float], float, int] | None]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model_path: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_kv_blocks: int | None,
        max_num_batched_tokens: int,
        gpu_memory_utilization: float,
        attention_backend: str,
        seed: int,
        max_model_len: int = 0,
        enforce_eager: bool = False,
        cuda_graph_max_batch: int = 0,
        compile_model: bool = False,
    ) -> None:
        self.cfg = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = get_backend(attention_backend, device)
        # Compiled: Inductor fuses the elementwise references itself; eager on CUDA: the
        # hand-written Triton kernels.
        ops.use_kernels(self.backend.name == "triton" and not compile_model)
        self.model = load_model(model_config, model_path, dtype, device)
        if compile_model:
            # Attention stays an opaque custom op (see layers/attention.py); token counts
            # vary every step, so shapes are dynamic.
            self.model.model = torch.compile(self.model.model, dynamic=True)
        self.attn_layers = self.model.attention_layers()  # type: ignore[operator]
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        if num_kv_blocks is None:
            num_kv_blocks = self._auto_num_blocks(max_num_batched_tokens, gpu_memory_utilization)
        self.num_kv_blocks = num_kv_blocks
        self._allocate_kv_cache(num_kv_blocks)
        self.graphs: DecodeGraphs | None = None
        use_graphs = device.type == "cuda" and self.backend.name == "triton"
        if use_graphs and not enforce_eager and cuda_graph_max_batch > 0:
            self.graphs = DecodeGraphs(
                self.model,
                self.backend,
                capture_sizes(cuda_graph_max_batch),
                -(-max_model_len // block_size),
                block_size,
                device,
            )
            self.graphs.capture()

    # ---- KV pool -------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        layer = self.attn_layers[0]
        elems = 2 * self.block_size * layer.num_kv_heads * layer.head_dim
        return elems * len(self.attn_layers) * torch.empty((), dtype=self.dtype).element_size()

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)

    def _auto_num_blocks(self, max_tokens: int, utilization: float) -> int:
        if self.device.type != "cuda":
            return max(1, CPU_KV_CACHE_BYTES // self.bytes_per_block)
        # Profile a full-size prefill to learn peak activation memory, then give the
        # rest of utilization * total memory to the KV pool.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n_blocks = -(-max_tokens // self.block_size)
        self._allocate_kv_cache(n_blocks)
        ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        meta = _metadata(
            [max_tokens],
            [max_tokens],
            [list(range(n_blocks))],
            list(range(max_tokens)),
            self.device,
        )
        with torch.inference_mode(), forward_context(self.backend, meta):
            hidden = self.model(ids, torch.arange(max_tokens, device=self.device))
            self.model.compute_logits(hidden[-1:])  # type: ignore[operator]
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self._allocate_kv_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * utilization) - peak - others
        blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {total * utilization / 2**30:.1f} GiB "
                f"allowed (gpu_memory_utilization={utilization}), model and activations take "
                f"{peak / 2**30:.1f} GiB; raise gpu_memory_utilization or lower "
                "max_num_batched_tokens"
            )
        log.info("KV cache: %d blocks (%.1f GiB)", blocks, blocks * self.bytes_per_block / 2**30)
        return int(blocks)

    # ---- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, eos_ids: dict[int, list[int]]) -> StepResult:
        """Runs the batch; ``eos_ids[seq_id]`` lists tokens banned for that row (min_tokens)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                sample_rows.append(b)
        tables = [s.block_table for s in batch.seqs]
        graphs = self.graphs
        if (
            graphs is not None
            and len(ids) == len(sample_rows) == len(batch.seqs)  # decode only
            and graphs.graph_size(len(ids)) is not None
        ):
            logits = graphs.run(ids, positions, slots, seq_lens, tables)
            return self._sample(batch.seqs, logits, eos_ids)
        dev = self.device
        meta = _metadata(q_lens, seq_lens, tables, slots, dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        with forward_context(self.backend, meta):
            hidden = self.model(input_ids, pos)
        seqs = [batch.seqs[b] for b in sample_rows]
        if not seqs:
            return StepResult([], [], [])
        last = [meta.query_start_loc_cpu[b + 1] - 1 for b in sample_rows]
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=dev)])  # type: ignore[operator]
        return self._sample(seqs, logits, eos_ids)

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, banned: dict[int, list[int]]
    ) -> StepResult:
        want_lp = [s.params.logprobs for s in seqs]
        raw = logits.clone() if any(k is not None for k in want_lp) else None
        for row, seq in enumerate(seqs):
            ban = banned.get(seq.seq_id)
            if ban:
                logits[row, ban] = float("-inf")
        t, prompt_mask, counts = self._sampling_tensors(seqs, logits.shape[1])
        tokens = sample(logits, t, [s.generator for s in seqs], self.generator, prompt_mask, counts)
        lps: list[tuple[list[int], list[float], float, int] | None] = [None] * len(seqs)
        if raw is not None:
            k = max(k or 0 for k in want_lp)
            top_ids, top_lp, s_lp, rank = top_logprobs(raw, tokens, k)
            top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
            s_lp, rank = s_lp.tolist(), rank.tolist()
            for row, kk in enumerate(want_lp):
                if kk is not None:
                    lps[row] = (top_ids[row][:kk], top_lp[row][:kk], s_lp[row], rank[row])
        return StepResult(seqs, tokens.tolist(), lps)

    def _sampling_tensors(
        self, seqs: list[Sequence], vocab: int
    ) -> tuple[SamplingTensors, torch.Tensor | None, torch.Tensor | None]:
        ps = [s.params for s in seqs]
        dev = self.device

        do_pen = any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in ps
        )
        # One host-to-device copy for all per-row parameters.
        cols = torch.tensor(
            [
                (
                    p.temperature,
                    p.top_k,
                    p.top_p,
                    p.min_p,
                    p.greedy,
                    p.repetition_penalty,
                    p.presence_penalty,
                    p.frequency_penalty,
                )
                for p in ps
            ],
            dtype=torch.float32,
        ).to(dev, non_blocking=True)
        t = SamplingTensors(
            temperature=cols[:, 0],
            top_k=cols[:, 1].long(),
            top_p=cols[:, 2],
            min_p=cols[:, 3],
            greedy=cols[:, 4].bool(),
            repetition_penalty=cols[:, 5],
            presence_penalty=cols[:, 6],
            frequency_penalty=cols[:, 7],
            do_top_k=any(p.top_k > 0 for p in ps),
            do_top_p_min_p=any(p.top_p < 1 or p.min_p > 0 for p in ps),
            do_penalties=do_pen,
        )
        if not do_pen:
            return t, None, None
        # Ragged token lists -> padded id matrices (pad id = vocab, a spare last column),
        # then one scatter each: no per-row device work.
        prompt_ids = _padded([s.prompt_token_ids for s in seqs], vocab, dev)
        output_ids = _padded([s.output_token_ids for s in seqs], vocab, dev)
        n = len(seqs)
        prompt_mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
        prompt_mask.scatter_(1, prompt_ids, True)
        counts = torch.zeros(n, vocab + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.int32))
        prompt_mask, counts = prompt_mask[:, :vocab], counts[:, :vocab]
        return t, prompt_mask, counts


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 ``[len(rows), max_len]`` tensor padded with ``pad`` (min width 1)."""
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)


def _metadata(
    q_lens: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    slots: list[int],
    device: torch.device,
) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
