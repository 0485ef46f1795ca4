"""The draft-model proposer: a small checkpoint (same tokenizer as the target) run by its
own ``Worker``, KV pool and ``BlockManager``, drafting ``k`` tokens per sequence.

Per sequence it keeps the tokens it last saw (the caller's accepted tokens followed by
its own drafts), its block table and how many of those tokens have K/V in the pool.
``propose`` keeps the longest common prefix of those tokens with the request's (rolling
the rest back with ``BlockManager.truncate``), runs one batched catch-up forward over
every token not yet computed (chunked at ``max_num_batched_tokens`` tokens, as a chunked
prefill) and draws draft 1 from each sequence's last position, then ``k - 1`` batched
one-token decode steps drawing drafts 2..k. Drafts 1..k-1 get K/V, so the next call's
common prefix keeps whatever the target accepted.

Draws: greedy requests (temperature 0) take the argmax (q: a point mass); sampled ones
draw from ``softmax(logits / temperature)`` truncated to its top ``top_m`` tokens and
renormalised, and report exactly those ``top_m`` ids and probabilities as q, so
verification stays exact. Each draw inverts the CDF at one uniform: a seeded request's
is a hash of ``(seed, len(token_ids), j)`` (the same request drafts the same tokens),
the others' come from the runner's own seeded stream. Draft ``j``'s token is fed to step
``j + 1`` on the device (the worker's placeholder mechanism), so the GPU path syncs at
most once per call, when the drafts are read: ``propose`` reads them at once;
``propose_on_device`` (the engine's in-process path) leaves them on the device for the
target's verify step and reads them at the next call, when they are long done.

On a GPU a step of at most ``DRAFT_GRAPH_MAX_BATCH`` new tokens replays a decode CUDA
graph, laid out one row per token (``as_decode_rows``): the one-token decode steps and,
at small batches, the catch-up; larger steps run eagerly. A full pool never fails a
call: idle sequences (not in the batch) are freed longest-idle first, then sequences
that still do not fit draft fewer tokens, or none. Not thread-safe: one caller.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvscale.server.config import DEFAULT_BATCH, EngineConfig, ModelConfig, ResolvedConfig
from kvscale.server.engine.block_manager import BlockManager
from kvscale.server.layers.sampler import row_seed
from kvscale.server.spec_decode.prefix import as_token_list, held_prefix_len
from kvscale.server.spec_decode.proposer import DeviceProposal, DraftRequest, Proposal
from kvscale.server.spec_decode.tokenizer_check import check_same_tokenizer
from kvscale.server.worker.step import StepInput, as_decode_rows
from kvscale.server.worker.worker import Worker

log = logging.getLogger(__name__)

DEFAULT_TOP_M = 8
DRAFT_GRAPH_MAX_BATCH = 64  # decode graphs of the draft: up to this many rows (tokens)
DEFAULT_KV_CACHE_BYTES = 1 << 30  # cap of the default pool (max_num_seqs x max_model_len)
_MASK64 = (1 << 64) - 1
_U_BITS = 24  # uniforms are multiples of 2**-24: exact in float32 and < 1


@dataclass
class _Seq:
    tokens: list[int]  # accepted tokens, then this runner's drafts
    base: int  # how many of ``tokens`` came from the caller
    table: list[int]  # block ids
    computed: int  # leading tokens whose K/V is in ``table``
    last_used: int  # the propose() call that last touched it


@dataclass
class _Row:
    """A request that drafts in this call."""

    row: int  # index in the batch
    seq: _Seq
    n: int  # len(token_ids)
    k: int  # drafts this call, >= 1
    temperature: float
    seed: int | None  # reduced mod 2**64


def _block_tables(rows: list[_Row]) -> np.ndarray:
    """The rows' block tables, int32 ``[len(rows), longest]``, zero-padded."""
    tables = np.zeros((len(rows), max(len(r.seq.table) for r in rows)), dtype=np.int32)
    for t, r in enumerate(rows):
        tables[t, : len(r.seq.table)] = r.seq.table
    return tables


def _slots(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, bs: int) -> np.ndarray:
    """The KV slots (int64) of ``positions`` of table rows ``rows`` (blocks of ``bs``)."""
    return tables[rows, positions // bs].astype(np.int64) * bs + positions % bs


def _draw_params(rows: list[_Row]) -> tuple[np.ndarray, np.ndarray]:
    """What sampled draws read per row: temperature (float32, 1 for greedy rows) and
    whether the row is greedy (bool)."""
    temp = np.array([max(r.temperature, 0.0) or 1.0 for r in rows], dtype=np.float32)
    return temp, np.array([r.temperature <= 0 for r in rows], dtype=bool)


@dataclass
class _DecodeRows:
    """The rows of a call's one-token decode steps, as arrays (their block tables do not
    change within a call: ``_plan`` allocated room for every draft)."""

    rows: list[_Row]
    idx: np.ndarray  # [S] int64: the rows' indices in the call
    n: np.ndarray  # [S] int64: their token counts
    tables: np.ndarray  # [S, W] int32, zero-padded
    temp: np.ndarray  # [S] float32: temperature, 1 for greedy rows
    greedy: np.ndarray  # [S] bool

    @staticmethod
    def of(rows: list[_Row], active: tuple[int, ...]) -> _DecodeRows:
        chosen = [rows[i] for i in active]
        return _DecodeRows(
            chosen,
            np.array(active, dtype=np.int64),
            np.fromiter((r.n for r in chosen), np.int64, len(chosen)),
            _block_tables(chosen),
            *_draw_params(chosen),
        )

    def arrays(self, j: int, block_size: int) -> dict[str, np.ndarray]:
        """The step that feeds draft ``j - 1`` of each row (a placeholder: the worker's
        ``last_tokens``, see ``_draw``) at position ``n + j - 1``; what sampled draws
        need (``draft_u``, ``draft_temp``, ``draft_greedy``) is left to the caller."""
        s = len(self.idx)
        positions = self.n + (j - 1)
        return {
            "ids": -(self.idx + 1),
            "positions": positions,
            "slots": _slots(self.tables, np.arange(s), positions, block_size),
            "seq_lens": (positions + 1).astype(np.int32),
            "q_start": np.arange(s + 1, dtype=np.int32),
            "tables": self.tables,
            "logits_idx": np.arange(s, dtype=np.int64),
            "draft_rows": self.idx,
        }


def draft_uniform(seed: int, num_tokens: int, j: int) -> float:
    """The uniform in [0, 1) that draft ``j`` (0-based) of a request seeded with ``seed``
    with ``num_tokens`` accepted tokens inverts its CDF at."""
    x = row_seed(row_seed(seed & _MASK64, num_tokens), j)  # in [0, 2**63)
    return (x >> (63 - _U_BITS)) / float(1 << _U_BITS)


def draft_engine_config(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    block_size: int = 16,
    max_num_seqs: int = DEFAULT_BATCH[0],
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    num_kv_blocks: int | None = None,
    attention_backend: str = "auto",
    seed: int = 0,
) -> EngineConfig:
    """A draft model's engine settings: decode CUDA graphs up to
    ``DRAFT_GRAPH_MAX_BATCH`` rows, no prefix caching, one rank, its ``max_model_len``
    capped at what the checkpoint allows."""
    limit = EngineConfig(model=model).resolve_max_model_len(ModelConfig.from_path(model))
    return EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=limit if max_model_len is None else min(max_model_len, limit),
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        attention_backend=attention_backend,
        cuda_graph_mode="full_decode_only",
        cuda_graph_max_batch=DRAFT_GRAPH_MAX_BATCH,
        enable_prefix_caching=False,
        seed=seed,
    )


def pool_blocks(
    config: ResolvedConfig, kv_cache_tokens: int | None, max_bytes: int = DEFAULT_KV_CACHE_BYTES
) -> int:
    """KV blocks of a draft pool: ``kv_cache_tokens`` if given, else room for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at ``max_bytes``."""
    eng, m = config.engine, config.model
    per_block = (
        2 * m.num_layers * m.num_kv_heads * m.head_dim * eng.block_size
        * config.kv_cache_dtype.itemsize
    )  # fmt: skip
    if kv_cache_tokens is not None:
        return max(1, -(-kv_cache_tokens // eng.block_size))
    blocks = eng.max_num_seqs * -(-config.max_model_len // eng.block_size)
    cap = max(1, max_bytes // per_block)
    if blocks > cap:
        log.info(
            "draft KV pool: %d blocks (%.2f GiB) instead of room for %d sequences of %d tokens",
            cap, cap * per_block / 2**30, eng.max_num_seqs, config.max_model_len,
        )  # fmt: skip
        return cap
    return blocks


class DraftRunner:
    """A ``Proposer`` (name "draft") running a draft checkpoint in this process."""

    name = "draft"

    def __init__(
        self,
        config: ResolvedConfig,
        k: int,
        top_m: int = DEFAULT_TOP_M,
        vocab_limit: int | None = None,
    ) -> None:
        """``config``: the draft's (``num_kv_blocks`` set; see ``from_engine_config``);
        ``k``: most drafts per sequence (larger requests are clipped); ``top_m``: the
        support of sampled drafts' q; ``vocab_limit``: drafts stay below it (the
        target's vocabulary size when it is smaller than the draft's)."""
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k}: must be >= 1")
        if top_m < 1:
            raise ValueError(f"top_m={top_m}: must be >= 1")
        self.config = config
        self.max_k = k
        self.worker = Worker(config)
        self.device = self.worker.device
        self.vocab_size = min(config.model.vocab_size, vocab_limit or config.model.vocab_size)
        self.top_m = min(top_m, self.vocab_size)
        self.block_size = config.engine.block_size
        self.max_model_len = config.max_model_len
        self.max_step_tokens = config.max_num_batched_tokens  # also the most rows per call
        self.block_manager = BlockManager(self.worker.num_kv_blocks, self.block_size)
        self._seqs: dict[int, _Seq] = {}
        self._rng = np.random.default_rng(config.engine.seed)
        self._calls = 0
        self._warned: set[str] = set()
        # one call's drafts on the device: tokens [P, K], q ids/probs [P, K, M], and its
        # rows, until ``_settle`` reads them back
        self._tokens = self._q_ids = self._q_probs = torch.empty(0)
        self._pending: list[_Row] = []

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_engine_config(
        cls,
        engine: EngineConfig,
        k: int,
        top_m: int = DEFAULT_TOP_M,
        vocab_limit: int | None = None,
        kv_cache_tokens: int | None = None,
    ) -> DraftRunner:
        """Resolves ``engine`` (see ``draft_engine_config``) and sizes its pool
        (``pool_blocks``) unless ``num_kv_blocks`` is set."""
        resolved = engine.resolve()
        if engine.num_kv_blocks is None:
            blocks = pool_blocks(resolved, kv_cache_tokens)
            resolved = replace(resolved, engine=replace(resolved.engine, num_kv_blocks=blocks))
        return cls(resolved, k, top_m, vocab_limit)

    @classmethod
    def from_model_path(
        cls,
        path: str,
        target: ResolvedConfig,
        k: int,
        top_m: int = DEFAULT_TOP_M,
        kv_cache_tokens: int | None = None,
        num_kv_blocks: int | None = None,
    ) -> DraftRunner:
        """The draft for ``target``, in its process: same device, dtype, block size and
        batch limits; its own pool (``kv_cache_tokens`` or ``num_kv_blocks``, default:
        ``pool_blocks``). ValueError if the tokenizers differ. On a GPU, build it before
        the target's worker sizes its pool from the memory left, or lower the target's
        ``gpu_memory_utilization`` to leave room for it."""
        check_same_tokenizer(target.engine.tokenizer or target.engine.model, path)
        eng = target.engine
        engine = draft_engine_config(
            path,
            device=target.device,
            dtype=str(target.dtype).removeprefix("torch."),
            block_size=eng.block_size,
            max_num_seqs=eng.max_num_seqs,
            max_model_len=target.max_model_len,
            max_num_batched_tokens=eng.max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks,
            attention_backend=eng.attention_backend,
            seed=eng.seed,
        )
        return cls.from_engine_config(engine, k, top_m, target.model.vocab_size, kv_cache_tokens)

    # ---- the Proposer interface ----------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Up to ``min(k, max_k)`` drafts per request; q for the whole batch when any
        request samples (greedy rows as point masses), else None."""
        with torch.inference_mode():
            dp = self._enqueue(requests)
            host = self._settle()
        kmax = max((r.k for r in requests), default=0)
        out = Proposal.empty(len(requests), kmax)
        if dp.q_ids is not None:
            out.q_ids = np.zeros((len(requests), kmax, self.top_m), dtype=np.int32)
            out.q_probs = np.zeros((len(requests), kmax, self.top_m), dtype=np.float32)
        if host is None:
            return out
        tokens, q_ids, q_probs = host
        for b, i in enumerate(dp.rows.tolist()):
            if i < 0:
                continue
            d = int(dp.num_tokens[b])
            out.tokens[b, :d] = tokens[i, :d]
            out.num_tokens[b] = d
            if q_ids is not None and q_probs is not None:
                assert out.q_ids is not None and out.q_probs is not None
                out.q_ids[b, :d] = q_ids[i, :d]
                out.q_probs[b, :d] = q_probs[i, :d]
        return out

    def propose_on_device(self, requests: list[DraftRequest]) -> DeviceProposal:
        """``propose``'s drafts left on the device (``DeviceProposer``): the forwards are
        queued and the call returns without a sync; the runner reads its own drafts back
        at its next call, when the GPU has long finished them."""
        with torch.inference_mode():
            return self._enqueue(requests)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Frees the blocks and state of these sequences (unknown ids are ignored)."""
        self._settle()
        for sid in seq_ids:
            seq = self._seqs.pop(sid, None)
            if seq is not None:
                self.block_manager.free(seq.table)

    def reset(self) -> None:
        """Forgets every sequence."""
        self.release(list(self._seqs))

    def close(self) -> None:
        self.reset()

    # ---- introspection (tests, metrics) ----------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def tables(self) -> list[list[int]]:
        """The live block tables (``block_manager.check(runner.tables())``)."""
        return [s.table for s in self._seqs.values()]

    def held_tokens(self, seq_id: int) -> list[int] | None:
        """The tokens it holds for a sequence (accepted + its drafts), None if none."""
        self._settle()
        seq = self._seqs.get(seq_id)
        return None if seq is None else list(seq.tokens)

    # ---- planning ----------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _plan(self, requests: list[DraftRequest]) -> list[_Row]:
        """Rolls each request's sequence back to its common prefix and allocates its
        blocks; returns the rows that draft, in batch order."""
        self._calls += 1
        in_batch = {r.seq_id for r in requests}
        if len(in_batch) != len(requests):
            raise ValueError("a seq_id appears twice in one propose() batch")
        rows: list[_Row] = []
        for i, r in enumerate(requests):
            tokens = as_token_list(r.token_ids)
            n = len(tokens)
            k = min(r.k, self.max_k, self.max_model_len - n + 1)
            if i >= self.max_step_tokens:
                self._warn_once("rows", "draft: batches over %d rows get no drafts past it", i)
                k = 0
            seq = self._seqs.get(r.seq_id)
            if k < 1 or n == 0:
                self.release([r.seq_id])
                continue
            if seq is None:
                seq = self._seqs[r.seq_id] = _Seq([], 0, [], 0, self._calls)
            same = held_prefix_len(seq.tokens, tokens, seq.base)
            keep = min(same, seq.computed, n - 1)
            fed = tokens[keep:]
            if min(fed) < 0 or max(fed) >= self.config.model.vocab_size:
                self._warn_once("ids", "draft: a request holds token ids outside the vocabulary")
                self.release([r.seq_id])
                continue
            self.block_manager.truncate(seq.table, keep)
            # its own list, updated in place: O(new tokens), never the caller's list
            del seq.tokens[same:]
            seq.tokens.extend(tokens[same:])
            seq.base, seq.computed, seq.last_used = n, keep, self._calls
            k = self._fit(seq, n, k, in_batch)
            if k < 1:
                self._warn_once("full", "draft: the KV pool is full; some sequences get no drafts")
                self.release([r.seq_id])
                continue
            rows.append(_Row(i, seq, n, k, float(r.temperature), _seed(r.seed)))
        return rows

    def _fit(self, seq: _Seq, n: int, k: int, in_batch: set[int]) -> int:
        """Allocates K/V room for ``n + k' - 1`` tokens, ``k' <= k`` as large as fits after
        freeing idle sequences longest-idle first; returns ``k'`` (0: not even one)."""
        bm = self.block_manager
        if not bm.can_allocate(seq.table, n + k - 1):
            idle = sorted(
                (s.last_used, sid) for sid, s in self._seqs.items() if sid not in in_batch
            )
            reachable = len(seq.table) + bm.num_free_blocks
            reachable += sum(len(self._seqs[sid].table) for _, sid in idle)
            if reachable * self.block_size < n:  # not even one draft after freeing them all
                return 0
            for _, sid in idle:
                self.release([sid])
                if bm.can_allocate(seq.table, n + k - 1):
                    break
            room = (len(seq.table) + bm.num_free_blocks) * self.block_size
            k = min(k, room - n + 1)
            if k < 1:
                return 0
        bm.allocate(seq.table, n + k - 1)
        return k

    # ---- running -----------------------------------------------------------------------
    def _enqueue(self, requests: list[DraftRequest]) -> DeviceProposal:
        """Plans the call (after reading the last call's drafts back) and queues its
        forwards and draws; the drafts stay on the device until ``_settle``."""
        self._settle()
        b = len(requests)
        want_q = any(r.temperature > 0 for r in requests)
        rows = self._plan(requests)
        num = np.zeros(b, dtype=np.int64)
        where = np.full(b, -1, dtype=np.int64)
        p, k = len(rows), max((r.k for r in rows), default=0)
        dev = self.device
        m = self.top_m if want_q else 0
        self._tokens = torch.zeros(p, k, dtype=torch.long, device=dev)
        self._q_ids = torch.zeros(p, k, m, dtype=torch.long, device=dev)
        self._q_probs = torch.zeros(p, k, m, dtype=torch.float32, device=dev)
        if rows:
            self._catch_up(rows, want_q)
            batches: dict[tuple[int, ...], _DecodeRows] = {}
            for j in range(1, k):
                active = [i for i, r in enumerate(rows) if r.k > j]
                for lo in range(0, len(active), self.max_step_tokens):
                    part = tuple(active[lo : lo + self.max_step_tokens])
                    if part not in batches:  # the same rows step after step: built once
                        batches[part] = _DecodeRows.of(rows, part)
                    self._decode(batches[part], j, want_q)
            for i, r in enumerate(rows):
                num[r.row], where[r.row] = r.k, i
            self._pending = rows
        q = (self._q_ids, self._q_probs) if want_q else (None, None)
        return DeviceProposal(num, where, self._tokens, *q)

    def _settle(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
        """Reads the last call's drafts back (a sync, unless they were read already) and
        records them as held: each drafting sequence then holds its tokens and drafts,
        with K/V for all but the last draft. Returns them (tokens ``[P, K]`` int64, q ids
        int32 and probs ``[P, K, M]`` or None), None when that call drafted nothing."""
        rows, self._pending = self._pending, []
        if not rows:
            return None
        tokens = self._tokens.cpu().numpy()
        want_q = self._q_ids.shape[-1] > 0
        q_ids = self._q_ids.to(torch.int32).cpu().numpy() if want_q else None
        q_probs = self._q_probs.cpu().numpy() if want_q else None
        for i, r in enumerate(rows):
            seq = r.seq
            seq.tokens.extend(tokens[i, : r.k].tolist())
            seq.computed = r.n + r.k - 1
        return tokens, q_ids, q_probs

    def _catch_up(self, rows: list[_Row], want_q: bool) -> None:
        """Feeds every row's uncomputed tokens (chunks of at most ``max_step_tokens``),
        drawing draft 1 from each row's last position."""
        budget = self.max_step_tokens
        segs: list[tuple[int, int, int]] = []  # (row index, start, end)
        used = 0
        for i, r in enumerate(rows):
            start = r.seq.computed
            while start < r.n:
                end = min(r.n, start + budget - used)
                segs.append((i, start, end))
                used += end - start
                start = end
                if used == budget:
                    self._run(rows, segs, 0, want_q)
                    segs, used = [], 0
            r.seq.computed = r.n
        if segs:
            self._run(rows, segs, 0, want_q)

    def _decode(self, active: _DecodeRows, j: int, want_q: bool) -> None:
        """One token per active row: draft ``j - 1`` (a placeholder for row i's slot of
        the worker's ``last_tokens``) at position ``n + j - 1``; draws draft ``j``."""
        arrays = active.arrays(j, self.block_size)
        if want_q:
            arrays["draft_u"] = self._uniforms(active.rows, j)
            arrays["draft_temp"], arrays["draft_greedy"] = active.temp, active.greedy
        s = len(active.idx)
        step = StepInput(arrays, s, 1, int(active.n.max()) + j)
        graph = self.worker.decode_graph_size(s)
        if graph:  # already one row per token: only the padding to the graph's rows
            as_decode_rows(arrays, s, graph)
            step.graph_size = graph
        self._forward(step, j, want_q)

    def _run(
        self,
        rows: list[_Row],
        segs: list[tuple[int, int, int]],
        j: int,
        want_q: bool,
    ) -> None:
        """One forward over ``segs`` (row index, first position, end position), then
        draft ``j`` of the rows whose segment ends at their last fed position."""
        bs = self.block_size
        s = len(segs)
        idx = np.fromiter((g[0] for g in segs), dtype=np.int64, count=s)
        start = np.fromiter((g[1] for g in segs), dtype=np.int64, count=s)
        end = np.fromiter((g[2] for g in segs), dtype=np.int64, count=s)
        length = end - start
        q_start = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(length, out=q_start[1:])
        total = int(q_start[-1])
        seg_of = np.repeat(np.arange(s), length)
        positions = start[seg_of] + np.arange(total) - q_start[seg_of]
        tables = _block_tables([rows[i] for i in idx.tolist()])
        slots = _slots(tables, seg_of, positions, bs)
        ids = np.concatenate([rows[i].seq.tokens[a:b] for i, a, b in segs], dtype=np.int64)
        last = np.array([b == rows[i].n + j for i, _, b in segs], dtype=bool)
        sampled = idx[last]
        arrays = {
            "ids": ids.astype(np.int64),
            "positions": positions.astype(np.int64),
            "slots": slots,
            "seq_lens": end.astype(np.int32),
            "q_start": q_start.astype(np.int32),
            "tables": tables,
            "logits_idx": (q_start[1:][last] - 1).astype(np.int64),
            "draft_rows": sampled,
        }
        if want_q:  # what sampled draws need (greedy calls take the argmax only)
            drawn = [rows[i] for i in sampled.tolist()]
            arrays["draft_u"] = self._uniforms(drawn, j)
            arrays["draft_temp"], arrays["draft_greedy"] = _draw_params(drawn)
        step = StepInput(arrays, s, int(length.max()), int(end.max()))
        graph = self.worker.decode_graph_size(total)
        if graph:  # one row per token, replayed from the decode graph of ``graph`` rows
            step.num_seqs = as_decode_rows(arrays, s, graph)
            step.max_query_len, step.graph_size = 1, graph
        self._forward(step, j, want_q)

    def _forward(self, step: StepInput, j: int, want_q: bool) -> None:
        """The step's forward, then draft ``j`` of its ``draft_rows``."""
        fwd = self.worker.forward(step)
        if len(step.arrays["draft_rows"]):
            self._draw(fwd.logits, fwd.dev, j, want_q)

    def _uniforms(self, rows: list[_Row], j: int) -> np.ndarray:
        """One uniform per row for draft ``j``: hashed from a seeded request's seed, else
        from the runner's stream (drawn from only by calls that sample)."""
        u = self._rng.integers(0, 1 << _U_BITS, size=len(rows)) / float(1 << _U_BITS)
        for n, r in enumerate(rows):
            if r.seed is not None:
                u[n] = draft_uniform(r.seed, r.n, j)
        return u.astype(np.float32)

    def _draw(
        self, logits: torch.Tensor, dev: dict[str, torch.Tensor], j: int, want_q: bool
    ) -> None:
        """Draft ``j`` of rows ``dev["draft_rows"]`` from their logits ``[S, V]`` (the
        model's dtype; divided by the fp32 temperatures they become fp32, exactly), into
        ``_tokens[:, j]`` (and ``_q_*[:, j]``) and the worker's ``last_tokens``."""
        if logits.shape[1] > self.vocab_size:
            logits[:, self.vocab_size :] = float("-inf")
        rows = dev["draft_rows"]
        greedy_tok = logits.argmax(dim=-1)
        if want_q:
            vals, ids = (logits / dev["draft_temp"].unsqueeze(1)).topk(self.top_m, dim=-1)
            probs = torch.softmax(vals, dim=-1)
            cdf = probs.cumsum(dim=-1)
            x = (dev["draft_u"] * cdf[:, -1]).unsqueeze(1)
            pick = torch.searchsorted(cdf, x, right=True)
            nonzero = (probs > 0).sum(dim=-1, keepdim=True)
            pick = torch.minimum(pick, nonzero - 1)  # rounding at the top end
            greedy = dev["draft_greedy"]
            tok = torch.where(greedy, greedy_tok, ids.gather(1, pick).squeeze(1))
            # greedy rows: [argmax, the other top ids] with probabilities [1, 0, ...]
            # (distinct ids, so scattering q into [V] never collides)
            g = greedy_tok.unsqueeze(1)
            point_ids = torch.cat([g, torch.where(ids[:, 1:] == g, ids[:, :1], ids[:, 1:])], 1)
            point = torch.zeros_like(probs)
            point[:, 0] = 1.0
            self._q_ids[rows, j] = torch.where(greedy.unsqueeze(1), point_ids, ids)
            self._q_probs[rows, j] = torch.where(greedy.unsqueeze(1), point, probs)
        else:
            tok = greedy_tok
        self._tokens[rows, j] = tok
        self.worker.last_tokens[rows] = tok


def _seed(seed: int | None) -> int | None:
    return None if seed is None else int(seed) & _MASK64
