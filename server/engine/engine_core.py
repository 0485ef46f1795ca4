"""The engine core (the driver): token ids in, token ids out, one scheduled step at a time.

It owns the scheduler, the KV block manager and the sequences, hands each step to the
worker as a ``StepInput`` (plain arrays, ``step_inputs``), and applies the stop rules
that need no text (EOS, stop token ids, ``max_tokens``, the context length).
Text (detokenization, stop strings, logprob tokens) is the output processor's job, on
the other side of the process boundary when serving.

Steps are pipelined one deep: ``step()`` schedules and launches step N+1, then waits for
step N's sampled tokens and turns them into ``SeqUpdate``s, so the host's scheduling,
input preparation and bookkeeping run while the GPU computes. Step N+1 feeds the tokens
step N sampled as placeholders that the device resolves. A sequence that step N
finished (EOS) was already scheduled in N+1: that one extra row is computed and
dropped. A sequence whose last token is in flight (``max_tokens``) is not scheduled.
Finishing or aborting frees blocks at once; a step still in flight may write stale KV
into them, but every later step runs after it on the same stream, so the blocks' next
owner overwrites that before reading.

Structured outputs: a constrained request waits (unscheduled) until its grammar is
compiled on a background thread (``structured.manager``). A step whose sampling rows
include constrained ones is launched in two halves: the forward pass first, then,
once the previous step's tokens are read and fed to the grammars, the token bitmasks
are filled and the sampling is enqueued. The GPU computes the forward pass meanwhile,
so the pipeline loses only what the host's read and mask filling take beyond it.

Speculative decoding (``speculation``): a step in which some sequence may draft (the
batch is small enough, see ``Speculator.ready``) is not pipelined: the step before is
read first, drafts are proposed from the known tokens, and the step (last token + drafts
per speculating sequence) is launched and read at once, so the host's scheduling and the
proposer no longer overlap the GPU's work on those steps. A verify row
emits its accepted drafts plus one token of the target's; the KV of rejected positions is
rolled back (computed-token count and block table truncated, blocks freed).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.config import ResolvedConfig
from kvscale.server.distributed import make_worker
from kvscale.server.engine.block_manager import BlockManager
from kvscale.server.engine.core_outputs import EngineStats, SeqUpdate
from kvscale.server.engine.request import Request
from kvscale.server.engine.scheduler import ScheduledBatch, Scheduler
from kvscale.server.engine.sequence import Sequence
from kvscale.server.engine.speculation import Speculator
from kvscale.server.engine.step_inputs import build_step, prompt_logprob_inputs
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.spec_decode.factory import make_proposer
from kvscale.server.structured.manager import GrammarManager
from kvscale.server.worker.worker import PendingStep, Worker

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # an otherwise idle step waits this long for a grammar to compile


@dataclass
class _Inflight:
    """A launched step: its pending results and where each sampled token goes."""

    pending: PendingStep
    seqs: list[Sequence]  # the sequence of each sampling row
    positions: list[int]  # index in seq.token_ids of each sampled row's placeholder
    prompt_lp: list[tuple[Sequence, int]] = field(default_factory=list)  # rows per seq


class EngineCore:
    """Not thread-safe: one loop drives it. Requests reach it validated
    (``request.validate_request``, at the engine's edge)."""

    def __init__(
        self,
        config: ResolvedConfig,
        worker: Worker | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """``worker``: default one for ``config`` (all its tensor-parallel ranks);
        ``on_failure(reason)``: called if a tensor-parallel rank fails."""
        self.config = config
        eng = config.engine
        self.max_model_len = config.max_model_len
        self.eos_token_ids = set(config.eos_token_ids)
        self.worker = worker if worker is not None else make_worker(config, on_failure)
        self.device = self.worker.device
        self.dtype = self.worker.dtype
        self.vocab_size = config.model.vocab_size
        self.block_manager = BlockManager(
            self.worker.num_kv_blocks, eng.block_size, eng.enable_prefix_caching
        )
        if self.block_manager.blocks_for(self.max_model_len) > self.block_manager.num_blocks:
            self.shutdown()  # no tensor-parallel rank outlives a core that cannot start
            capacity = self.block_manager.num_blocks * eng.block_size
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.block_manager.num_blocks} blocks of "
                f"{eng.block_size}), fewer than max_model_len={self.max_model_len}: raise "
                "num_kv_blocks / gpu_memory_utilization or lower max_model_len"
            )
        self.scheduler = Scheduler(
            self.block_manager, eng.max_num_seqs, config.max_num_batched_tokens
        )
        self.speculator: Speculator | None = None
        try:
            proposer = make_proposer(config)
        except BaseException:
            self.shutdown()
            raise
        if proposer is not None:
            self.speculator = Speculator(
                proposer,
                eng.num_speculative_tokens,
                eng.speculative_disable_by_batch_size,
                single_rank=eng.tensor_parallel_size == 1,
            )
            if self.speculator.follows_verify:  # the next step's drafts, queued on the device
                self.worker.set_verify_hook(self.speculator.after_verify)
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarManager(
            eng.tokenizer or eng.model, self.vocab_size, sorted(self.eos_token_ids)
        )
        self._awaiting_grammar: dict[str, tuple[Request, Future[Any]]] = {}
        self._refused: list[tuple[str, str]] = []
        self._inflight: _Inflight | None = None
        self._seq_ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # ---- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queues ``params.n`` sequences of a validated request (``cache_salt``: only
        requests with the same salt share prefix-cache blocks). ValueError (queues
        nothing) if ``request_id`` is in use."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [
            Sequence(
                next(self._seq_ids),
                request_id,
                i,
                prompt_ids,
                params.for_child(i),
                now,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        req = Request(request_id, list(prompt_ids), params, seqs, now)
        self.requests[request_id] = req
        if params.structured_outputs is not None:
            future = self.grammars.submit(params.structured_outputs)
            self._awaiting_grammar[request_id] = (req, future)
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _admit_compiled(self) -> None:
        """Schedules the requests whose grammars are compiled (one matcher per sample);
        refuses those whose grammar failed (``take_refused``)."""
        for rid, (req, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[rid]
            try:
                compiled = future.result()
            except Exception as e:
                log.warning("request %s: grammar compilation failed: %s", rid, e)
                self.requests.pop(rid, None)
                self._refused.append((rid, f"cannot compile the grammar: {e}"))
                continue
            for seq in req.seqs:
                seq.grammar = self.grammars.matcher(compiled)
                self.scheduler.add(seq)

    def take_refused(self) -> list[tuple[str, str]]:
        """``(request_id, reason)`` of requests dropped since the last call (their
        grammar could not be compiled); they produce no more outputs."""
        out, self._refused = self._refused, []
        return out

    def abort_request(self, request_id: str) -> bool:
        """Drops a request now and frees its blocks; False if it is not known."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if self._awaiting_grammar.pop(request_id, None) is not None:
            return True  # never scheduled
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort", time.monotonic())
        return True

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Ends sample ``index`` of a request as stopped (the output side found a stop
        string); unknown or already finished sequences are ignored."""
        req = self.requests.get(request_id)
        if req is None or not 0 <= index < len(req.seqs) or req.seqs[index].is_finished:
            return
        self._finish(req.seqs[index], "stop", time.monotonic())
        if req.finished:
            del self.requests[request_id]

    def abort_all(self) -> list[str]:
        """Drops every request and the step in flight (after a failed step); returns the
        dropped request ids."""
        rids = list(self.requests)
        for rid in rids:
            self.abort_request(rid)
        self._inflight = None
        self.block_manager.reset_cache()  # the failed step may not have written its blocks
        return rids

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block hash; returns how many were dropped."""
        return self.block_manager.reset_cache()

    def has_work(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    def shutdown(self) -> None:
        """Stops the worker's other tensor-parallel ranks (none for one rank) and the
        draft (a sidecar's connection, an in-process draft's pool)."""
        spec = getattr(self, "speculator", None)
        if spec is not None:
            spec.close()
        stop = getattr(self.worker, "shutdown", None)
        if stop is not None:
            stop()

    # ---- one step ------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        """Launches the next batch, then returns the tokens of the step launched before
        (a speculative step returns its own)."""
        spec = self.speculator
        if spec is not None and spec.ready(self.scheduler.running, self.max_model_len):
            return self._spec_step(spec)
        if self._awaiting_grammar:
            self._admit_compiled()
        batch = self.scheduler.schedule()
        inflight = self._inflight
        updates: list[SeqUpdate] | None = None
        launched = None
        if batch.seqs:
            launched, updates = self._launch(batch, inflight)
        self._inflight = launched
        if updates is None:
            updates = self._collect(inflight) if inflight is not None else []
        if launched is None and inflight is None and self._awaiting_grammar:
            # nothing to run until a grammar is ready: wait for one, briefly
            wait([f for _, f in self._awaiting_grammar.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        return updates

    def _spec_step(self, spec: Speculator) -> list[SeqUpdate]:
        """One unpipelined step with drafts: reads the step in flight, drafts from the
        known tokens, then launches and reads this one (when no proposal had a draft, it
        is left in flight: the next step is pipelined behind it)."""
        updates = self._collect(self._inflight) if self._inflight is not None else []
        self._inflight = None
        if self._awaiting_grammar:
            self._admit_compiled()
        spec.draft(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        scheduled = set(map(id, batch.seqs))
        for seq in self.scheduler.running:  # drafted, then left out by the token budget:
            if seq.draft_tokens and id(seq) not in scheduled:  # no stale drafts for a later
                seq.draft_tokens, seq.draft_q, seq.draft_src = [], None, -1  # (pipelined) step
        if batch.seqs:
            launched, early = self._launch(batch, None)
            updates += early or []
            if any(seq.draft_tokens for seq in batch.seqs):
                updates += self._collect(launched)
            else:  # nothing was drafted: the step stays in flight, as a pipelined one
                self._inflight = launched
        elif self._awaiting_grammar:
            wait([f for _, f in self._awaiting_grammar.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        return updates

    def _launch(
        self, batch: ScheduledBatch, prev: _Inflight | None
    ) -> tuple[_Inflight, list[SeqUpdate] | None]:
        """Launches ``batch``. When grammars constrain some of its sampling rows, reads
        ``prev``'s tokens between the forward pass and the sampling (their masks need
        them) and returns prev's updates; else None (``prev`` is still to collect)."""
        now = time.monotonic()
        banned: dict[int, list[int]] = {}
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if seq.num_output_tokens < seq.params.min_tokens:
                banned[seq.seq_id] = self._min_tokens_ban(seq)
        grammar_bans = {
            s.seq_id: banned.pop(s.seq_id, None) for s in batch.seqs if s.grammar is not None
        }
        # Every sequence feeds its last token (plus any drafts): a decode step, or a verify
        # step that replays a decode graph as one row per token (see as_decode_rows).
        at_last = all(s.num_computed_tokens + 1 == s.num_tokens for s in batch.seqs)
        tokens = sum(batch.num_new_tokens)
        graph = self.worker.decode_graph_size(tokens) if at_last else 0
        spec = self.speculator
        step, seqs = build_step(
            batch,
            self.config.engine.block_size,
            graph,
            banned,
            self.vocab_size,
            decode_rows=bool(graph) and tokens > len(batch),
            drafts=spec.device_drafts if spec is not None else None,
        )
        if step.sampling.spec_k and spec is not None and spec.follows_verify:
            spec.stage([seqs[r] for r in step.sampling.spec_rows])
        prompt_lp = prompt_logprob_inputs(batch, step)
        if prompt_lp and step.graph_size:  # never for decode-shaped steps; kept safe
            step.graph_size = 0
        updates = None
        if step.sampling.grammar_rows:
            forwarded = self.worker.forward(step)
            updates = self._collect(prev) if prev is not None else []
            rows = [seqs[r] for r in step.sampling.grammar_rows]
            bitmask = self.grammars.fill(
                [None if s.is_finished else s.grammar for s in rows],
                [grammar_bans.get(s.seq_id) for s in rows],
                [s.params.structured_outputs.kind for s in rows],  # type: ignore[union-attr]
            )
            pending = self.worker.sample(forwarded, bitmask)
        else:
            pending = self.worker.launch(step)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        for seq, count in prompt_lp:
            seq.prompt_lp_next += count
        positions = []
        for row, seq in enumerate(seqs):
            positions.append(seq.num_tokens)
            if seq.is_finished:  # ended by prev's tokens, read above: an extra row
                continue
            seq.token_ids.append(-(row + 1))
            max_tokens = seq.params.max_tokens
            if (
                max_tokens is not None and seq.num_output_tokens >= max_tokens
            ) or seq.num_tokens >= self.max_model_len:
                seq.stopping = True
        return _Inflight(pending, seqs, positions, prompt_lp), updates

    def _collect(self, inflight: _Inflight) -> list[SeqUpdate]:
        result = inflight.pending.result()
        now = time.monotonic()
        updates: list[SeqUpdate] = []
        i = 0
        for seq, count in inflight.prompt_lp:
            if seq.prompt_lps is not None and not seq.is_finished:
                seq.prompt_lps.extend(result.prompt_logprobs[i : i + count])
            i += count
        for row, (seq, pos, token, lp) in enumerate(
            zip(inflight.seqs, inflight.positions, result.token_ids, result.logprobs, strict=True)
        ):
            if seq.is_finished:  # aborted, or ended by the step before: an extra row
                continue
            emitted = result.spec_tokens.get(row)
            if emitted is not None:
                self._emit_verified(seq, pos, emitted, now, updates)
                continue
            self._emit(seq, pos, token, lp, now, updates)
        return updates

    def _emit_verified(
        self, seq: Sequence, pos: int, emitted: list[int], now: float, updates: list[SeqUpdate]
    ) -> None:
        """A verify row's tokens (its accepted drafts, then the target's): emitted in order
        until one ends the sequence; the KV of the rejected drafts is rolled back."""
        drafted, accepted = len(seq.draft_tokens), len(emitted) - 1
        assert self.speculator is not None
        self.speculator.record(seq, drafted, accepted)
        seq.draft_tokens = []
        seq.draft_q = None
        seq.draft_src = -1
        for j, token in enumerate(emitted):
            if j:
                seq.token_ids.append(token)
            self._emit(seq, pos + j, token, None, now, updates)
            if seq.is_finished:
                return  # its blocks are freed
        # the step computed K/V for the last token and every draft; keep the accepted ones
        seq.num_computed_tokens -= drafted - accepted
        self.block_manager.truncate(seq.block_table, seq.num_computed_tokens)

    def _emit(
        self,
        seq: Sequence,
        pos: int,
        token: int,
        lp: Any,
        now: float,
        updates: list[SeqUpdate],
    ) -> None:
        """Puts ``token`` at ``seq.token_ids[pos]`` and reports it (finishing ``seq`` if it
        stops it)."""
        seq.token_ids[pos] = token
        if seq.grammar is not None and not seq.grammar.is_terminated():
            if not seq.grammar.accept_token(token):  # the mask allowed it: a bug
                log.error("request %s: the grammar rejected token %d", seq.request_id, token)
        seq.token_times.append(now)
        self._generation_tokens += 1
        k = pos - seq.num_prompt_tokens + 1  # this token's 1-based index in the output
        if k == 1 and seq.index == 0:
            self._prompt_tokens += seq.num_prompt_tokens
        reason, stop_token = self._stop_reason(seq, token, k, pos)
        if reason is not None:
            seq.stop_reason = stop_token
            self._finish(seq, reason, now)
            req = self.requests.get(seq.request_id)
            if req is not None and req.finished:
                del self.requests[seq.request_id]
        updates.append(
            SeqUpdate(
                seq.request_id,
                seq.index,
                token,
                lp,
                reason,
                stop_token,
                seq.first_scheduled_time if k == 1 else None,
                seq.prompt_lps if k == 1 and seq.prompt_lps is not None else None,
            )
        )

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.drop_placeholders()
        seq.draft_tokens = []
        if self.speculator is not None:
            self.speculator.release((seq.seq_id,))
        seq.grammar = None
        seq.finish_reason = reason
        seq.finished_time = now
        self.scheduler.finish(seq)

    def _stop_reason(
        self, seq: Sequence, token: int, k: int, pos: int
    ) -> tuple[str | None, int | None]:
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated():
            # the grammar took a stop token: the output is complete
            return "stop", (token if token in (p.stop_token_ids or ()) else None)
        if k >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in (p.stop_token_ids or ()):
                return "stop", token
        if (p.max_tokens is not None and k >= p.max_tokens) or pos + 1 >= self.max_model_len:
            return "length", None
        return None, None

    def _min_tokens_ban(self, seq: Sequence) -> list[int]:
        ban = list(seq.params.stop_token_ids or [])
        if not seq.params.ignore_eos:
            ban.extend(self.eos_token_ids)
        return ban

    # ---- introspection ---------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        s = self.speculator.stats
        proposer = self.speculator.proposer
        return dict(
            spec_num_drafts=s.num_drafts,
            spec_num_draft_tokens=s.num_draft_tokens,
            spec_num_accepted_tokens=s.num_accepted_tokens,
            spec_accepted_per_pos=list(s.accepted_per_pos),
            spec_draft_available=getattr(proposer, "available", None),
            spec_draft_failures=getattr(proposer, "num_failures", 0),
        )
