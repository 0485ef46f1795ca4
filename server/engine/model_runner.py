"""Runs one scheduled batch through the model and samples the next tokens.

Owns the model, the paged KV pool (allocated once), the attention backend and the decode
CUDA graphs. ``launch`` builds the step's inputs on the host (``step_inputs``), copies
them in one pinned transfer, enqueues the forward pass and the sampling, and starts
copying the sampled tokens back, all without waiting for the GPU; the returned
``PendingStep`` waits only when its ``result()`` is read. So the engine can prepare and
launch step N+1 while the GPU still runs step N: step N+1 may feed tokens sampled in
step N as placeholders, which the device resolves from ``last_tokens``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvscale.server.attention.backend import get_backend
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.engine.core_outputs import RowLogprobs
from kvscale.server.engine.cuda_graphs import DecodeGraphs, capture_sizes
from kvscale.server.engine.host_to_device import to_device
from kvscale.server.engine.scheduler import ScheduledBatch
from kvscale.server.engine.sequence import Sequence
from kvscale.server.engine.step_inputs import (
    StepPlan,
    padded_rows,
    plan_step,
    resolve_placeholders,
)
from kvscale.server.forward_context import forward_context
from kvscale.server.layers import ops
from kvscale.server.layers.sampler import SamplingTensors, sample, top_logprobs
from kvscale.server.loader import load_model
from kvscale.server.model_config import ModelConfig
from kvscale.server.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU when num_kv_blocks is not given


@dataclass
class StepResult:
    """For each sequence that sampled (in batch order): its token and optional logprobs."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[RowLogprobs | None]


class PendingStep:
    """A launched step whose sampled tokens (and logprobs) are being copied to the host."""

    def __init__(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor | None,
        logprobs: tuple[torch.Tensor, ...] | None,
        want_logprobs: list[int | None],
        on_cuda: bool = False,
    ) -> None:
        self.seqs = seqs
        self._tokens = tokens
        self._logprobs = logprobs
        self._want = want_logprobs
        self._event: torch.cuda.Event | None = None
        if on_cuda:  # marks the end of the copies just enqueued
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> StepResult:
        """Waits for the copies (the GIL is released while waiting)."""
        if self._event is not None:
            self._event.synchronize()
        if self._tokens is None:
            return StepResult([], [], [])
        tokens = self._tokens.tolist()
        lps: list[RowLogprobs | None] = [None] * len(tokens)
        if self._logprobs is not None:
            top_ids, top_lp, s_lp, rank = (t.tolist() for t in self._logprobs)
            for row, k in enumerate(self._want):
                if k is not None:
                    lps[row] = (top_ids[row][:k], top_lp[row][:k], s_lp[row], rank[row])
        return StepResult(self.seqs, tokens, lps)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Starts a device-to-host copy into pinned memory (a no-op on CPU)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


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
        self.vocab_size = model_config.vocab_size
        self.backend = get_backend(attention_backend, device)
        # Compiled: Inductor fuses the elementwise references itself; eager on CUDA: the
        # hand-written Triton kernels.
        ops.use_kernels(self.backend.name == "triton" and not compile_model)
        self.model = load_model(model_config, model_path, dtype, device)
        self.compiled = compile_model
        if compile_model:
            # Attention stays an opaque custom op (see layers/attention.py); token counts
            # vary every step, so shapes are dynamic.
            self.model.model = torch.compile(self.model.model, dynamic=True)
        self.attn_layers = self.model.attention_layers()  # type: ignore[operator]
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._neg_inf = torch.full((), float("-inf"), device=device)
        # The tokens sampled by the latest step that sampled (row r at index r).
        self.last_tokens = torch.zeros(
            max(1, max_num_batched_tokens), dtype=torch.long, device=device
        )
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
                self.last_tokens,
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
        seq = Sequence(0, "profile", 0, [0] * max_tokens, SamplingParams(max_tokens=1))
        seq.block_table = list(range(n_blocks))
        plan = plan_step(ScheduledBatch([seq], [max_tokens]), self.block_size)
        with torch.inference_mode():
            self._forward_eager(plan, to_device(plan.arrays, self.device))
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
    def execute(self, batch: ScheduledBatch, banned: dict[int, list[int]]) -> StepResult:
        """Runs the batch and waits for its sampled tokens."""
        return self.launch(batch, banned).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, banned: dict[int, list[int]]) -> PendingStep:
        """Enqueues the batch's forward pass and sampling; ``banned[seq_id]`` lists tokens
        that sequence may not sample this step (EOS before ``min_tokens``)."""
        graphs = self.graphs
        pad = 0
        if graphs is not None and all(
            n == 1 and s.num_computed_tokens + 1 == s.num_tokens
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ):
            pad = graphs.graph_size(len(batch)) or 0
        plan = plan_step(batch, self.block_size, pad)
        seqs = [batch.seqs[b] for b in plan.sample_rows]
        arrays = dict(plan.arrays)
        flags = self._sampling_arrays(seqs, banned, arrays)
        dev = to_device(arrays, self.device)
        if pad:
            assert graphs is not None
            logits = graphs.run(dev, len(batch))
        else:
            logits = self._forward_eager(plan, dev)
        if not seqs:
            return PendingStep([], None, None, [])
        return self._sample(seqs, logits, dev, flags)

    def _forward_eager(self, plan: StepPlan, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on the step's device inputs; fp32 logits ``[S, V]`` of the rows that
        sample."""
        meta = AttentionMetadata(
            slot_mapping=dev["slots"],
            query_start_loc=dev["q_start"],
            seq_lens=dev["seq_lens"],
            block_tables=dev["tables"],
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
            query_start_loc_cpu=plan.q_starts,
            seq_lens_cpu=plan.seq_lens,
        )
        ids = resolve_placeholders(dev["ids"], self.last_tokens)
        positions = dev["positions"]
        if self.compiled:
            # A view into the packed buffer has a storage offset that varies with the
            # step's sizes; Dynamo guards on it and would recompile: pass a fresh tensor.
            positions = positions.clone()
        with forward_context(self.backend, meta):
            hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden[dev["logits_idx"]])  # type: ignore[operator]

    # ---- sampling ----------------------------------------------------------------------
    def _sampling_arrays(
        self, seqs: list[Sequence], banned: dict[int, list[int]], arrays: dict[str, np.ndarray]
    ) -> dict[str, bool]:
        """Adds the sampling inputs of ``seqs`` to ``arrays``; returns host-side flags."""
        ps = [s.params for s in seqs]
        arrays["sampling"] = np.array(
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
            dtype=np.float32,
        ).reshape(len(ps), 8)
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for row, seq in enumerate(seqs):
            ban = banned.get(seq.seq_id)
            if ban:
                ban_rows.extend([row] * len(ban))
                ban_cols.extend(ban)
        if ban_rows:
            arrays["ban_rows"] = np.array(ban_rows, dtype=np.int64)
            arrays["ban_cols"] = np.array(ban_cols, dtype=np.int64)
        do_pen = any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in ps
        )
        if do_pen:
            # pad id = vocab, a spare last column; output ids may hold placeholders
            arrays["prompt_ids"] = padded_rows([s.prompt_token_ids for s in seqs], self.vocab_size)
            arrays["output_ids"] = padded_rows([s.output_token_ids for s in seqs], self.vocab_size)
        return {
            "all_greedy": all(p.greedy for p in ps),
            "do_top_k": any(p.top_k > 0 for p in ps),
            "do_top_p_min_p": any(p.top_p < 1 or p.min_p > 0 for p in ps),
            "do_penalties": do_pen,
            "ban": bool(ban_rows),
        }

    def _sample(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        dev: dict[str, torch.Tensor],
        flags: dict[str, bool],
    ) -> PendingStep:
        want_lp = [s.params.logprobs for s in seqs]
        raw = logits.clone() if any(k is not None for k in want_lp) else None
        if flags["ban"]:
            # a tensor value: assigning a Python float copies it to the device and syncs
            logits.index_put_((dev["ban_rows"], dev["ban_cols"]), self._neg_inf)
        cols = dev["sampling"]
        t = SamplingTensors(
            temperature=cols[:, 0],
            top_k=cols[:, 1].long(),
            top_p=cols[:, 2],
            min_p=cols[:, 3],
            greedy=cols[:, 4].bool(),
            repetition_penalty=cols[:, 5],
            presence_penalty=cols[:, 6],
            frequency_penalty=cols[:, 7],
            do_top_k=flags["do_top_k"],
            do_top_p_min_p=flags["do_top_p_min_p"],
            do_penalties=flags["do_penalties"],
            all_greedy=flags["all_greedy"],
        )
        prompt_mask = counts = None
        if flags["do_penalties"]:
            prompt_mask, counts = self._penalty_inputs(dev, len(seqs))
        tokens = sample(logits, t, [s.generator for s in seqs], self.generator, prompt_mask, counts)
        self.last_tokens[: len(seqs)].copy_(tokens)
        host_lp = None
        if raw is not None:
            k = max(k or 0 for k in want_lp)
            host_lp = tuple(_to_host(x) for x in top_logprobs(raw, tokens, k))
        return PendingStep(seqs, _to_host(tokens), host_lp, want_lp, self.device.type == "cuda")

    def _penalty_inputs(
        self, dev: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, V]`` prompt-token mask and output-token counts, one scatter each."""
        vocab = self.vocab_size
        output_ids = resolve_placeholders(dev["output_ids"], self.last_tokens)
        prompt_mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=self.device)
        prompt_mask.scatter_(1, dev["prompt_ids"], True)
        counts = torch.zeros(n, vocab + 1, dtype=torch.int32, device=self.device)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.int32))
        return prompt_mask[:, :vocab], counts[:, :vocab]
