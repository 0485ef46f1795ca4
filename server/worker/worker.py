"""The worker of one rank: runs a ``StepInput`` through the model and samples.

It owns the model (this rank's shard), the KV pool (allocated once), the attention
backend, the CUDA graphs (whole-model graphs for decode steps, piecewise graphs for
mixed steps; ``graph_dispatch`` picks one per step) and the sampler's state, and knows
nothing of requests or sequences. ``launch`` copies the step's arrays to the device in
one pinned transfer, enqueues the forward pass and the sampling, and starts copying the
sampled tokens back, all without waiting for the GPU; the returned ``PendingStep`` waits
only when its ``result()`` is read. So the driver can prepare and launch step N+1 while
the GPU still runs step N: step N+1 may feed tokens sampled in step N as placeholders,
which the device resolves from ``last_tokens``.

With tensor parallelism every rank runs a ``Worker`` on its shard (``ParallelState``)
and launches the same steps; rank 0 samples and broadcasts the sampled tokens, which
the other ranks store in their own ``last_tokens``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvscale.server.attention.backend import get_backend
from kvscale.server.attention.forward_context import forward_context
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.compilation.config import CompilationConfig, auto_graph_mode
from kvscale.server.config import ResolvedConfig
from kvscale.server.engine.core_outputs import RowLogprobs
from kvscale.server.layers import ops
from kvscale.server.layers.sampler import (
    SamplingTensors,
    apply_logit_bias,
    apply_token_bitmask,
    sample,
    seeded_generators,
    target_distribution,
    top_logprobs,
)
from kvscale.server.models.loader import load_model
from kvscale.server.parallel import SINGLE, ParallelState
from kvscale.server.quantization import Fp8OnlineConfig, get_quantization
from kvscale.server.sampling_params import MAX_LOGPROBS
from kvscale.server.spec_decode.rejection_sampler import (
    RejectionOutput,
    greedy_verify,
    rejection_sample,
)
from kvscale.server.spec_decode.verify_probs import (
    expand_rows,
    verify_output_counts,
    verify_probs,
)
from kvscale.server.worker.cuda_graphs import DecodeGraphs, capture_sizes
from kvscale.server.worker.graph_dispatch import EAGER, GraphDispatcher
from kvscale.server.worker.host_to_device import to_device
from kvscale.server.worker.kv_calibration import KVScaleCalibration
from kvscale.server.worker.kv_pool import KVPool
from kvscale.server.worker.piecewise_graphs import PiecewiseGraphs
from kvscale.server.worker.step import (
    SamplingPlan,
    StepInput,
    profile_step,
    resolve_placeholders,
    sampler_profile_step,
)

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU when num_kv_blocks is not given
PROMPT_LOGPROB_CHUNK = 1024  # prompt-logprob rows whose [rows, V] logits exist at once


@dataclass
class StepResult:
    """For each sampling row, in order: its token and optional logprobs; and the prompt
    logprobs of the step's ``plp_idx`` rows, in order."""

    token_ids: list[int]
    logprobs: list[RowLogprobs | None]
    prompt_logprobs: list[RowLogprobs] = field(default_factory=list)
    # verify rows: sampling row -> its emitted tokens (accepted drafts, then the target's)
    spec_tokens: dict[int, list[int]] = field(default_factory=dict)


class PendingStep:
    """A launched step whose sampled tokens (and logprobs) are being copied to the host."""

    def __init__(
        self,
        tokens: torch.Tensor | None,
        logprobs: tuple[torch.Tensor, ...] | None,
        want_logprobs: list[int | None],
        on_cuda: bool = False,
        prompt_logprobs: tuple[torch.Tensor, ...] | None = None,
        spec: tuple[list[int], torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``spec``: (verify rows, their tokens [N, K + 1], accepted counts [N])."""
        self._spec = spec
        self._tokens = tokens
        self._logprobs = logprobs
        self._want = want_logprobs
        self._prompt = prompt_logprobs
        self._event: torch.cuda.Event | None = None
        if on_cuda:  # marks the end of the copies just enqueued
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def num_rows(self) -> int:
        """Sampling rows of the step."""
        return len(self._want)

    def result(self) -> StepResult:
        """Waits for the copies (the GIL is released while waiting)."""
        if self._event is not None:
            self._event.synchronize()
        prompt: list[RowLogprobs] = []
        if self._prompt is not None:
            p_ids, p_top, p_lp, p_rank = (t.tolist() for t in self._prompt)
            prompt = list(zip(p_ids, p_top, p_lp, p_rank, strict=True))
        if self._tokens is None:
            return StepResult([], [], prompt)
        tokens = self._tokens.tolist()
        lps: list[RowLogprobs | None] = [None] * len(tokens)
        if self._logprobs is not None:
            top_ids, top_lp, s_lp, rank = (t.tolist() for t in self._logprobs)
            for row, k in enumerate(self._want):
                if k is not None:
                    lps[row] = (top_ids[row][:k], top_lp[row][:k], s_lp[row], rank[row])
        spec: dict[int, list[int]] = {}
        if self._spec is not None:
            rows, spec_tokens, accepted = self._spec
            for row, toks, a in zip(rows, spec_tokens.tolist(), accepted.tolist(), strict=True):
                spec[row] = toks[: a + 1]
                tokens[row] = toks[0]
        return StepResult(tokens, lps, prompt, spec)


@dataclass
class Forwarded:
    """A step whose forward pass is enqueued and whose sampling is not yet: the logits
    of its sampling rows and its device inputs (see ``Worker.forward``)."""

    step: StepInput
    logits: torch.Tensor
    dev: dict[str, torch.Tensor]
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None


def _sampling_tensors(cols: torch.Tensor, plan: SamplingPlan) -> SamplingTensors:
    """The sampling parameters of ``cols [R, 8]`` (the ``sampling`` array's columns)."""
    return SamplingTensors(
        temperature=cols[:, 0],
        top_k=cols[:, 1].long(),
        top_p=cols[:, 2],
        min_p=cols[:, 3],
        greedy=cols[:, 4].bool(),
        repetition_penalty=cols[:, 5],
        presence_penalty=cols[:, 6],
        frequency_penalty=cols[:, 7],
        do_top_k=plan.do_top_k,
        top_k_max=plan.top_k_max,
        do_top_p_min_p=plan.do_top_p_min_p,
        do_penalties=plan.do_penalties,
        all_greedy=plan.all_greedy,
    )


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Starts a device-to-host copy into pinned memory (a no-op on CPU)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class Worker:
    """One rank's model, KV pool, attention backend, CUDA graphs and sampler."""

    def __init__(self, config: ResolvedConfig, parallel: ParallelState = SINGLE) -> None:
        eng = config.engine
        self.config = config
        self.device = device = config.torch_device
        self.dtype = config.dtype
        self.block_size = eng.block_size
        self.vocab_size = config.model.vocab_size
        self.backend = get_backend(eng.attention_backend, device)
        # Compiled: Inductor fuses the elementwise references itself; eager on CUDA: the
        # hand-written Triton kernels.
        self.use_kernels = use_kernels = self.backend.name == "triton" and not eng.compile
        # The routing while this worker builds (profiling, calibration, capture); each
        # step sets it again (see forward): another engine in this process may change it.
        ops.use_kernels(use_kernels)
        if parallel.world_size > 1 and use_kernels and not eng.disable_custom_all_reduce:
            from kvscale.server.distributed.one_shot import setup_one_shot

            one_shot = setup_one_shot(
                parallel.group,
                parallel.rank,
                parallel.world_size,
                device,
                config.model.hidden_size,
                self.dtype,
            )  # the Triton path only: its add + norm is the kernels' (ops)
            parallel = replace(parallel, one_shot=one_shot)
        self.parallel = parallel
        quant = get_quantization(config.model, eng.quantization)
        if quant is not None:
            log.info("quantization: %s", quant.describe())
        self.model = load_model(config.model, eng.model, self.dtype, device, parallel, quant)
        self.compiled = eng.compile
        mode = "none" if eng.enforce_eager else eng.cuda_graph_mode
        if mode == "auto":
            mode, why = auto_graph_mode(
                cuda=device.type == "cuda",
                triton=self.backend.name == "triton",
                quantized=quant is not None,
                fp8_at_load=isinstance(quant, Fp8OnlineConfig),
                kv_quantized=config.kv_cache_dtype.itemsize < 2,
                tensor_parallel=parallel.world_size > 1,
                speculative=eng.speculative_method is not None,
                compiled=eng.compile,
            )
            log.info("cuda graph mode: auto -> %s (%s)", mode, why)
        self.cuda_graph_mode = mode  # as resolved
        piecewise = mode in ("full_and_piecewise", "piecewise")
        if eng.compile and not piecewise:
            # Attention stays an opaque custom op (see layers/attention.py); token counts
            # vary every step, so shapes are dynamic.
            self.model.model = torch.compile(self.model.model, dynamic=True)
        self.attn_layers = self.model.attention_layers()  # type: ignore[operator]
        first = self.attn_layers[0]
        self.kv_pool = KVPool(
            len(self.attn_layers),
            first.num_kv_heads,
            first.head_dim,
            eng.block_size,
            config.kv_cache_dtype,
            device,
        )
        self.generator = torch.Generator(device=device)
        # called after a verify step's rejection sampler (set_verify_hook)
        self.verify_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.generator.manual_seed(eng.seed)
        self._neg_inf = torch.full((), float("-inf"), device=device)
        # The tokens sampled by the latest step that sampled (row r at index r).
        self.last_tokens = torch.zeros(
            max(1, config.max_num_batched_tokens), dtype=torch.long, device=device
        )
        num_blocks = eng.num_kv_blocks or self._auto_num_blocks(
            config.max_num_batched_tokens, eng.gpu_memory_utilization
        )
        self.num_kv_blocks = parallel.min_int(num_blocks, device)  # every rank holds as many
        self.resize_kv_pool(self.num_kv_blocks)
        log.info(
            "KV cache: %d blocks of %d tokens, %s (%.2f GiB)",
            self.num_kv_blocks,
            eng.block_size,
            str(config.kv_cache_dtype).removeprefix("torch."),
            self.kv_pool.nbytes / 2**30,
        )
        if self.kv_pool.quantized:
            self._init_kv_scales()
        max_blocks = -(-config.max_model_len // eng.block_size)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        compilation = CompilationConfig.from_engine(eng)
        self.piecewise: PiecewiseGraphs | None = None
        if piecewise and compilation.capture_sizes:
            self.piecewise = self._piecewise(compilation, max_blocks, pool, use_kernels)
        self.graphs: DecodeGraphs | None = None
        max_batch = min(eng.cuda_graph_max_batch, eng.max_num_seqs)
        use_graphs = device.type == "cuda" and self.backend.name == "triton"
        full = mode in ("full_and_piecewise", "full_decode_only")
        if use_graphs and full and max_batch > 0:
            self.graphs = DecodeGraphs(
                self.model,
                self.backend,
                capture_sizes(max_batch),
                max_blocks,
                eng.block_size,
                self.last_tokens,
            )
            self.graphs.capture(pool)
        self.dispatcher = GraphDispatcher(
            tuple(self.graphs.batch_sizes) if self.graphs else (),
            compilation.capture_sizes if self.piecewise else (),
        )

    def _piecewise(
        self, compilation: CompilationConfig, max_blocks: int, pool: Any, use_kernels: bool
    ) -> PiecewiseGraphs | None:
        """The compiled and captured pieces; None (with a warning saying why) if the model
        cannot be compiled or captured this way: the engine then runs as without them."""
        eng = self.config.engine
        pw = PiecewiseGraphs(
            self.model,
            self.backend,
            compilation,
            eng.max_num_seqs,
            max_blocks,
            eng.block_size,
            self.last_tokens,
            pool,
        )
        try:
            with ops.routing_for_tracing(compilation.compiler, use_kernels):
                pw.compile()
            pw.capture()
        except Exception as e:
            log.warning(
                "piecewise CUDA graphs are off: compiling or capturing the model failed "
                "(%s: %s); mixed steps run eagerly. --cuda-graph-mode full_decode_only "
                "skips the attempt; --compile-debug and TORCH_LOGS=+dynamo say more",
                type(e).__name__,
                e,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            return None
        if eng.compile:  # decode graphs and eager steps run the compiled pieces too
            self.model.model = pw.compiled
        return pw

    def release_graphs(self) -> None:
        """Drops the captured CUDA graphs (decode and piecewise): the engine is stopping.
        NCCL's communicator teardown waits until no graph holds its collectives
        (pytorch#115388: ``destroy_process_group`` hung for the whole 10 s that
        ``leave_group`` gives it on 2 x H200, lease r19b), so a tensor-parallel worker
        drops them before it leaves the process group. Later steps run eagerly."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = None
        self.dispatcher = GraphDispatcher((), ())

    # ---- KV pool -------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return self.kv_pool.bytes_per_block

    def _auto_num_blocks(self, max_tokens: int, utilization: float) -> int:
        if self.device.type != "cuda":
            return max(1, CPU_KV_CACHE_BYTES // self.bytes_per_block)
        # Profile the largest step to learn peak activation and sampling memory, then give
        # the rest of utilization * total memory to the KV pool.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_memory(max_tokens)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * utilization) - peak - others
        blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {total * utilization / 2**30:.1f} GiB "
                f"allowed (gpu_memory_utilization={utilization}), the model, the largest "
                f"step's activations and a full batch's sampling take {peak / 2**30:.1f} GiB; "
                "raise gpu_memory_utilization or lower max_num_batched_tokens or max_num_seqs"
            )
        log.info("KV cache: %d blocks (%.1f GiB)", blocks, blocks * self.bytes_per_block / 2**30)
        return int(blocks)

    def profile_memory(self, max_tokens: int) -> torch.Tensor:
        """Runs the step whose peak memory the KV pool must leave room for, on a pool of
        its own size (freed after): a prefill of ``max_tokens`` tokens whose last rows
        sample as many rows as one step can (every sequence, with its verify rows under
        speculation) on the sampler's costliest path (``sampler_profile_step``), as vLLM's
        profile runs its sampler. Without it, sampling 1,024 rows of a 128k vocabulary
        with every transform (~4.7 GiB beyond the logits, counted on the CPU, NOTES e90)
        came out of the memory left outside ``gpu_memory_utilization``. Returns the
        sampled tokens ``[rows]``."""
        eng = self.config.engine
        per_seq = 1 + (eng.num_speculative_tokens if eng.speculative_method else 0)
        step = sampler_profile_step(
            max_tokens, self.block_size, eng.max_num_seqs * per_seq, self.vocab_size, MAX_LOGPROBS
        )
        self.resize_kv_pool(-(-max_tokens // self.block_size))
        rng = self.generator.get_state()  # the profile's draws leave the seeded stream as it was
        with torch.inference_mode():
            dev = to_device(step.arrays, self.device)
            self.sample(Forwarded(step, self._forward_eager(step, dev), dev))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.generator.set_state(rng)
        tokens = self.last_tokens[: step.sampling.num_rows].clone()
        self.resize_kv_pool(0)
        return tokens

    def resize_kv_pool(self, num_blocks: int) -> None:
        """The KV pool at ``num_blocks`` blocks (its old tensors freed), bound to every
        attention layer."""
        self.kv_pool.allocate(num_blocks)
        self.kv_pool.bind(self.attn_layers)

    def _init_kv_scales(self) -> None:
        """An FP8 cache's scales: the checkpoint's, else calibrated on a fixed prompt."""
        ks = [float(layer.k_scale) for layer in self.attn_layers]
        vs = [float(layer.v_scale) for layer in self.attn_layers]
        source = "from the checkpoint"
        if not all(math.isfinite(s) for s in ks + vs):
            ks, vs = self._calibrate_kv_scales()
            source = "calibrated"
        self.kv_pool.set_scales(ks, vs)
        log.info(
            "FP8 KV cache scales (%s): k %.3g-%.3g, v %.3g-%.3g",
            source, min(ks), max(ks), min(vs), max(vs),
        )  # fmt: skip

    def _calibrate_kv_scales(self) -> tuple[list[float], list[float]]:
        """Per-layer K and V scales from one prefill of the calibration tokens."""
        ids = self.config.calibration_ids
        capacity = self.num_kv_blocks * self.block_size
        n = min(len(ids), self.config.max_num_batched_tokens, capacity)
        if n < 1:
            raise ValueError("an FP8 KV cache without checkpoint scales needs calibration tokens")
        log.warning(
            "FP8 KV cache: the checkpoint has no KV scales; calibrating them on %d tokens of "
            "built-in text (per-layer absmax, %.0fx headroom)",
            n,
            KVScaleCalibration.headroom,
        )
        step = profile_step(n, self.block_size)
        step.arrays["ids"] = np.asarray(ids[:n], dtype=np.int64)
        inner, self.backend = self.backend, KVScaleCalibration(self.backend)
        try:
            with torch.inference_mode():
                self._forward_eager(step, to_device(step.arrays, self.device))
        finally:
            self.backend = inner
        layers = self.kv_pool.layers
        return [float(kv.k_scale) for kv in layers], [float(kv.v_scale) for kv in layers]

    def set_verify_hook(self, hook: Callable[[torch.Tensor, torch.Tensor], None] | None) -> None:
        """``hook(tokens [N, K + 1] int64, num_accepted [N])``: called with each verify
        step's rejection-sampler output on the device, before the copies to the host are
        queued (work it queues on the stream comes back with the step)."""
        self.verify_hook = hook

    # ---- one step ------------------------------------------------------------------
    def decode_graph_size(self, num_seqs: int) -> int:
        """The captured decode batch size a decode step of ``num_seqs`` rows replays
        (0: none; the step runs piecewise or eagerly)."""
        return self.dispatcher.decode_size(num_seqs)

    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """Enqueues the step's forward pass and sampling; returns at once."""
        return self.sample(self.forward(step))

    @torch.inference_mode()
    def forward(self, step: StepInput) -> Forwarded:
        """Enqueues the step's forward pass (and its prompt logprobs); returns at once.
        ``sample`` then enqueues its sampling: in between, the driver may learn the
        tokens of the step before (a grammar's next mask depends on them)."""
        # This worker's operator routing: the last engine built in this process (a CUDA
        # one next to a CPU one, an eager one next to a compiled one) may have changed it.
        with ops.kernels(self.use_kernels):
            return self._enqueue_forward(step)

    def _enqueue_forward(self, step: StepInput) -> Forwarded:
        dev = to_device(step.arrays, self.device)
        if step.drafts is not None:
            _place_drafts(step.drafts, dev)
        prompt_lp = None
        run = self.dispatcher.dispatch(step.num_tokens, step.graph_size)
        if run.kind == "piecewise" and step.sampling.prompt_logprobs is not None:
            run = EAGER  # prompt logprobs need the hidden states, which graphs do not keep
        if run.kind == "full":
            assert self.graphs is not None
            logits = self.graphs.run(dev, step.num_seqs)  # every real row's
            if step.arrays["logits_idx"].shape[0] != step.num_seqs:
                logits = logits[dev["logits_idx"]]  # one-token rows of which only some sample
        elif run.kind == "piecewise":
            assert self.piecewise is not None
            logits = self.piecewise.run(step, dev, run.size)
        else:
            hidden = self._run_model(step, dev)
            logits = self.model.compute_logits(hidden[dev["logits_idx"]])  # type: ignore[operator]
            if step.sampling.prompt_logprobs is not None:
                prompt_lp = self._prompt_logprobs(hidden, dev, step.sampling.prompt_logprobs)
        return Forwarded(step, logits, dev, prompt_lp)

    @torch.inference_mode()
    def sample(self, fwd: Forwarded, bitmask: np.ndarray | None = None) -> PendingStep:
        """Enqueues the sampling of a forwarded step; returns at once. ``bitmask``
        (int32 ``[R, ceil(V / 32)]``, one row per ``grammar_rows`` entry): the tokens a
        grammar allows each constrained row (bit t % 32 of word t // 32)."""
        plan = fwd.step.sampling
        if not self.parallel.is_driver:
            # Rank 0 samples; the other ranks keep its tokens for the next step's
            # placeholders (one small broadcast, instead of sampling in lockstep).
            if plan.num_rows:
                self.parallel.broadcast(self.last_tokens[: plan.num_rows])
            return PendingStep(None, None, [])
        host_plp = None
        if fwd.prompt_logprobs is not None:
            host_plp = tuple(_to_host(x) for x in fwd.prompt_logprobs)
        if not plan.num_rows:
            return PendingStep(None, None, [], self.device.type == "cuda", host_plp)
        if plan.grammar_rows:
            if bitmask is None or bitmask.shape[0] != len(plan.grammar_rows):
                raise ValueError(
                    f"the step has {len(plan.grammar_rows)} grammar-constrained rows; "
                    f"sample() needs a bitmask row for each"
                )
            fwd.dev.update(to_device({"bitmask": bitmask}, self.device))
        with ops.kernels(self.use_kernels):  # the sampler's argmax and top-p: as ``forward``
            return self._sample(plan, fwd.logits, fwd.dev, host_plp)

    def _run_model(self, step: StepInput, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on the step's device inputs; hidden states ``[T, H]``."""
        meta = AttentionMetadata(
            slot_mapping=dev["slots"],
            query_start_loc=dev["q_start"],
            seq_lens=dev["seq_lens"],
            block_tables=dev["tables"],
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        ids = resolve_placeholders(dev["ids"], self.last_tokens)
        positions = dev["positions"]
        if self.compiled:
            # A view into the packed buffer has a storage offset that varies with the
            # step's sizes; Dynamo guards on it and would recompile: pass a fresh tensor.
            positions = positions.clone()
        with forward_context(self.backend, meta):
            return self.model(ids, positions)

    def _forward_eager(self, step: StepInput, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on the step's device inputs; logits ``[S, V]`` (the model's dtype) of
        the rows that sample."""
        hidden = self._run_model(step, dev)
        return self.model.compute_logits(hidden[dev["logits_idx"]])  # type: ignore[operator]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, dev: dict[str, torch.Tensor], k: int
    ) -> tuple[torch.Tensor, ...]:
        """``(top_ids [P, k], top_lp [P, k], lp [P], rank [P])`` of each ``plp_ids``
        token under the logits of its ``plp_idx`` row, PROMPT_LOGPROB_CHUNK rows at a time."""
        idx, ids = dev["plp_idx"], dev["plp_ids"]
        parts = []
        for i in range(0, idx.shape[0], PROMPT_LOGPROB_CHUNK):
            rows = idx[i : i + PROMPT_LOGPROB_CHUNK]
            logits = self.model.compute_logits(hidden[rows]).float()  # type: ignore[operator]
            parts.append(top_logprobs(logits, ids[i : i + PROMPT_LOGPROB_CHUNK], k))
        return tuple(torch.cat(cols) for cols in zip(*parts, strict=True))

    # ---- sampling ----------------------------------------------------------------------
    def _sample(
        self,
        plan: SamplingPlan,
        logits: torch.Tensor,
        dev: dict[str, torch.Tensor],
        prompt_lp: tuple[torch.Tensor, ...] | None = None,
    ) -> PendingStep:
        argmax_only = plan.argmax_only  # once: it scans the rows' logprobs requests
        if not argmax_only:
            logits = logits.float()  # edited in place below (a copy unless fp32 already)
        full = None
        if plan.spec_k:  # verify rows: normal sampling reads each row's last position
            full, logits = logits, logits[dev["spec_last"]]
        want_lp = plan.logprobs
        raw = logits.clone() if any(k is not None for k in want_lp) else None
        if plan.ban:
            # a tensor value: assigning a Python float copies it to the device and syncs
            logits.index_put_((dev["ban_rows"], dev["ban_cols"]), self._neg_inf)
        if plan.bias:
            apply_logit_bias(logits, dev["bias_rows"], dev["bias_cols"], dev["bias_vals"])
        if plan.grammar_rows:
            apply_token_bitmask(logits, dev["grammar_rows"], dev["bitmask"])
        prompt_mask = counts = None
        if argmax_only:  # no parameter is read: no device tensors made of them
            tokens = ops.argmax(logits)
        else:
            t = _sampling_tensors(dev["sampling"], plan)
            if plan.do_penalties:
                prompt_mask, counts = self._penalty_inputs(dev, plan.num_rows)
            generators = seeded_generators(plan.seeds, self.device) if not plan.all_greedy else []
            tokens = sample(logits, t, generators, self.generator, prompt_mask, counts)
        spec = None
        if full is not None:
            spec = self._verify(plan, full, dev, prompt_mask, counts)
        self.last_tokens[: plan.num_rows].copy_(tokens)
        self.parallel.broadcast(self.last_tokens[: plan.num_rows])  # to the other ranks
        host_lp = None
        if raw is not None:
            k = max(k or 0 for k in want_lp)
            host_lp = tuple(_to_host(x) for x in top_logprobs(raw, tokens, k))
        return PendingStep(
            _to_host(tokens), host_lp, want_lp, self.device.type == "cuda", prompt_lp, spec
        )

    def _verify(
        self,
        plan: SamplingPlan,
        logits: torch.Tensor,
        dev: dict[str, torch.Tensor],
        prompt_mask: torch.Tensor | None,
        counts: torch.Tensor | None,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Rejection-samples the drafts of the verify rows (``engine.step_inputs.
        verify_inputs``) against ``logits [L, V]``, each position's distribution built as
        normal sampling builds it; returns (rows, tokens [N, K + 1], accepted [N]), the
        tensors being copied to the host."""
        rows = dev["spec_rows"]
        host_rows = plan.spec_rows
        k = plan.spec_k
        n = len(host_rows)
        drafts, num_draft = dev["spec_draft"], dev["spec_num_draft"]
        if plan.all_greedy and not plan.do_penalties:  # the argmax decides: a few kernels
            argmax = logits.argmax(dim=-1)[dev["spec_idx"]]
            return self._verified(host_rows, greedy_verify(drafts, num_draft, argmax))
        row_t = _sampling_tensors(dev["sampling"][rows], plan)
        t = expand_rows(row_t, k + 1)
        pos_mask = pos_counts = None
        if plan.do_penalties:
            assert prompt_mask is not None and counts is not None
            pos_mask = prompt_mask[rows].repeat_interleave(k + 1, dim=0)
            pos_counts = verify_output_counts(counts[rows], drafts, num_draft)
        lg = logits[dev["spec_idx"].reshape(-1)]  # a copy: verify_probs edits it in place
        if plan.all_greedy:  # the penalised argmax decides: no probabilities, no noise
            _, greedy_tokens = target_distribution(lg, t, pos_mask, pos_counts)
            out = greedy_verify(drafts, num_draft, greedy_tokens.view(n, k + 1))
            return self._verified(host_rows, out)
        probs, greedy_tokens = verify_probs(lg, t, pos_mask, pos_counts)
        vocab = probs.shape[-1]
        draft_probs = None
        if plan.spec_q:
            # sparse q -> dense [N, K, V] (scatter_add: zero-prob padding adds nothing)
            draft_probs = torch.zeros(n, k, vocab, device=self.device)
            draft_probs.scatter_add_(2, dev["spec_q_ids"], dev["spec_q_probs"])
        seeds = [plan.seeds[r] for r in host_rows]
        out = rejection_sample(
            probs.view(n, k + 1, vocab),
            drafts,
            num_draft,
            row_t.greedy,
            seeded_generators(seeds, self.device) if not plan.all_greedy else None,
            self.generator,
            draft_probs,
            greedy_tokens.view(n, k + 1),
        )
        return self._verified(host_rows, out)

    def _verified(
        self, host_rows: list[int], out: RejectionOutput
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Runs the verify hook on ``out``, then starts its copies to the host."""
        if self.verify_hook is not None:  # e.g. the next step's n-gram drafts
            self.verify_hook(out.tokens, out.num_accepted)
        return host_rows, _to_host(out.tokens), _to_host(out.num_accepted)

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


def _place_drafts(drafts: Any, dev: dict[str, torch.Tensor]) -> None:
    """Copies drafts still on the device (``DeviceProposal``: an in-process draft
    model's, queued before this step on the same stream) into the step's inputs in
    place of their placeholders: the fed ids, the verify rows' drafts and their q."""
    flat = drafts.tokens.reshape(-1)
    if "draft_dst" in dev:
        dev["ids"][dev["draft_dst"]] = flat[dev["draft_src"]]
    if "draft_spec_dst" not in dev:
        return
    dst, src = dev["draft_spec_dst"], dev["draft_spec_src"]
    dev["spec_draft"].view(-1)[dst] = flat[src]
    if drafts.q_ids is not None and "spec_q_ids" in dev:
        m = drafts.q_ids.shape[-1]
        width = dev["spec_q_ids"].shape[-1]
        q_ids, q_probs = dev["spec_q_ids"].view(-1, width), dev["spec_q_probs"].view(-1, width)
        q_ids[dst, :m] = drafts.q_ids.reshape(-1, m)[src]
        q_probs[dst, :m] = drafts.q_probs.reshape(-1, m)[src]
