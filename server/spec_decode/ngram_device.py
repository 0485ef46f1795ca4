"""The n-gram proposer on the GPU: each sequence's tokens kept in a device buffer, the
lookup one kernel launch for the whole batch (``kvscale.kernels.ngram_match``).

The host's part of a step is what changed since the last one: the tokens each sequence
accepted (a few per sequence), written with the batch's rows and lengths into pinned host
memory that the GPU reads directly. One launch writes them into their rows and scans
every sequence's whole history (tens of microseconds for 256 sequences of 2,048 tokens),
and writes the drafts back into pinned memory: no copy to enqueue, one wait. Same rule
and the same drafts as ``NgramProposer`` (the host proposer, used on CPU).

After a verify step the host's part can go too (``stage_verify`` + ``after_verify``, the
worker's verify hook): the same kernel is queued right after the rejection sampler, takes
each verify row's emitted tokens from the sampler's output on the device, appends them to
the row and drafts from there; the drafts come back with the step. The next ``propose``
then only looks them up (no launch, no wait) for the sequences whose tokens are exactly
what the device appended; the others (new, resumed, or grown by a normal step) take the
path above.

Memory: one int32 row per running sequence, ``max_model_len`` wide at most (grown by
doubling to the longest sequence seen): 256 sequences of 8,192 tokens take 8 MiB.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, getitem

import numpy as np
import torch

from kvscale.server.spec_decode.ngram_proposer import check_ngram_settings
from kvscale.server.spec_decode.proposer import DraftRequest, Proposal

MIN_WIDTH = 1024  # tokens a row holds at first
_K, _SEQ_ID, _TOKENS = attrgetter("k"), attrgetter("seq_id"), attrgetter("token_ids")


@dataclass
class _Staged:
    """A verify step's rows (``stage_verify``), and whether their lookup was queued."""

    ids: np.ndarray  # [N] the seq ids their rows held, in verify-row order
    slots: np.ndarray  # [N] their rows of the history
    event: torch.cuda.Event | None = None
    launched: bool = False


class DeviceNgramProposer:
    """``Proposer`` (name "ngram") whose lookups run on ``device`` (CUDA; on CPU only
    under the Triton interpreter, for tests)."""

    name = "ngram"

    def __init__(self, k: int, min_n: int, max_n: int, device: torch.device) -> None:
        check_ngram_settings(k, min_n, max_n)
        from kvscale.kernels.ngram_match import (  # triton: here only
            ngram_after_verify,
            ngram_match,
            pack_inputs,
        )

        self._match, self._pack = ngram_match, pack_inputs
        self._after_verify = ngram_after_verify
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._k_pow2 = 1 << (k - 1).bit_length()
        self.device = device
        self._hist = torch.zeros((0, MIN_WIDTH), dtype=torch.int32, device=device)
        self._slot: dict[int, int] = {}  # seq_id -> row of _hist
        self._free: list[int] = []
        # per row: tokens on the device, the sequence it holds (-1: free), and the length
        # at which _ready_drafts holds its drafts (made after a verify step; -1: none)
        self._upto = np.zeros(0, np.int64)
        self._owner = np.zeros(0, np.int64)
        self._ready_at = np.zeros(0, np.int64)
        self._ready_drafts = np.zeros((0, self._k_pow2), np.int32)
        self._ids: list[int] | None = None  # the last batch's seq ids and their rows
        self._slots = np.zeros(0, np.int64)
        # The kernel's inputs and outputs live in pinned host memory, which the GPU reads
        # and writes directly: a call is one launch and one wait, no copies to enqueue.
        self._in = self._staging(64, torch.int64)
        self._out = self._staging(16 * (self._k_pow2 + 1), torch.int32)
        self._in_np, self._out_np = self._in.numpy(), self._out.numpy()
        # after a verify step: its rows, the kernel's input and output (pinned)
        self._staged: _Staged | None = None
        self._vin = self._staging(64, torch.int64)
        self._vout = self._staging(16 * (self._k_pow2 + 2), torch.int32)
        self.ready_hits = 0  # proposals served from the verify step's follow-up

    def _staging(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.device.type == "cuda")

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Drafts of each request (point masses: q is None)."""
        b = len(requests)
        if b == 0:
            return Proposal.empty(0, 1)
        self._absorb()
        ks = np.fromiter(map(_K, requests), np.int64, count=b)
        res = Proposal.empty(b, int(ks.max()))
        ids = list(map(_SEQ_ID, requests))
        toks = list(map(_TOKENS, requests))
        length = np.fromiter(map(len, toks), np.int64, count=b)
        width = min(res.tokens.shape[1], self._k_pow2)
        slots = self._rows_of(ids)
        hit = self._ready_at[slots] == length  # the device appended exactly these tokens
        self._ready_at[slots] = -1
        if not hit.any():
            return self._result(res, self._lookup(slots, toks, length), ks, width)
        drafts = np.empty((b, self._k_pow2), np.int32)
        drafts[hit] = self._ready_drafts[slots[hit]]
        self.ready_hits += int(hit.sum())
        miss = np.flatnonzero(~hit)
        if len(miss):
            drafts[miss] = self._lookup(slots[miss], [toks[i] for i in miss], length[miss])
        return self._result(res, drafts, ks, width)

    def _result(self, res: Proposal, drafts: np.ndarray, ks: np.ndarray, width: int) -> Proposal:
        """``res`` filled from ``drafts [B, k_pow2]`` (-1: nothing matched), cut to each k."""
        nums = np.where(drafts[:, 0] >= 0, np.minimum(ks, self.k), 0)
        keep = np.arange(width)[None, :] < nums[:, None]
        res.tokens[:, :width] = np.where(keep, drafts[:, :width], -1)
        res.num_tokens[:] = nums
        return res

    def _rows_of(self, ids: list[int]) -> np.ndarray:
        """The rows of ``ids`` (new ones get a row), cached for a batch like the last."""
        if ids != self._ids:
            self._slots = np.fromiter(map(self._slot_of, ids), np.int64, count=len(ids))
            self._ids = ids
        return self._slots

    def _lookup(self, slots: np.ndarray, toks: list, length: np.ndarray) -> np.ndarray:
        """One launch: the new tokens of each sequence into its row, then the drafts
        ``[B, k_pow2]`` int32 (-1 where nothing matched)."""
        b = len(slots)
        upto = self._upto[slots]
        upto[upto > length] = 0  # not a continuation of what the row holds: start over
        self._grow(int(length.max()))
        new = length - upto
        flat = np.fromiter(
            chain.from_iterable(map(getitem, toks, map(slice, upto.tolist(), repeat(None)))),
            np.int64,
            count=int(new.sum()),
        )
        self._upto[slots] = length
        # the kernel's input in pinned memory (its layout: pack_inputs)
        size = 4 * (b + (b & 1)) + len(flat)
        if self._in.numel() < size:
            self._in = self._staging(2 * size, torch.int64)
            self._in_np = self._in.numpy()
        if self._out.numel() < b * (self._k_pow2 + 1):
            self._out = self._staging(2 * b * (self._k_pow2 + 1), torch.int32)
            self._out_np = self._out.numpy()
        self._pack(slots, length, upto, flat, out=self._in_np)
        self._match(self._hist, self._in, b, self._k_pow2, self.min_n, self.max_n, True, self._out)
        if self.device.type == "cuda":  # the stream the kernel was launched on
            torch.cuda.current_stream(self.device).synchronize()
        return self._out_np[: b * (self._k_pow2 + 1)].reshape(b, -1)[:, :-1]

    # ---- the verify step's follow-up (the worker's verify hook) -------------------------
    def stage_verify(self, seq_ids: list[int]) -> None:
        """Called before a verify step is launched, with its verify rows' sequences in row
        order (each proposed for in this step: its row holds its tokens up to the drafts)."""
        self._staged = None
        n = len(seq_ids)
        if n == 0:
            return
        if seq_ids == self._ids:  # the batch proposed for (the usual case)
            slots = self._slots
        else:
            slots = np.fromiter(map(self._slot.get, seq_ids, repeat(-1)), np.int64, count=n)
            if slots.min() < 0:
                return  # a row this proposer did not draft for: no follow-up this step
        upto = self._upto[slots]
        self._grow(int(upto.max()) + self.k + 1)
        n2 = n + (n & 1)
        if self._vin.numel() < 2 * n2:
            self._vin = self._staging(4 * n2, torch.int64)
        if self._vout.numel() < n * (self._k_pow2 + 2):
            self._vout = self._staging(2 * n * (self._k_pow2 + 2), torch.int32)
        vin = self._vin.numpy()
        vin[:n], vin[n2 : n2 + n] = slots, upto
        self._staged = _Staged(self._owner[slots], slots.copy())

    def after_verify(self, tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """The worker's verify hook: queued after the rejection sampler, on its stream.
        ``tokens [N, T]`` int64 and ``num_accepted [N]``: its output for the staged rows."""
        st = self._staged
        if st is None or st.launched or tokens.shape[0] != len(st.ids):
            self._staged = None
            return
        self._after_verify(
            self._hist, self._vin, tokens, num_accepted, self._k_pow2, self.min_n,
            self.max_n, self._vout,
        )  # fmt: skip
        st.launched = True
        if self.device.type == "cuda":
            st.event = torch.cuda.Event()
            st.event.record()

    def _absorb(self) -> None:
        """Takes in the last verify follow-up's drafts and the rows' new lengths."""
        st, self._staged = self._staged, None
        if st is None or not st.launched:
            return
        if st.event is not None:
            st.event.synchronize()  # done when the engine read the step; cheap then
        n, w = len(st.ids), self._k_pow2 + 2
        out = self._vout.numpy()[: n * w].reshape(n, w)
        kept = self._owner[st.slots] == st.ids  # a row released since may hold another
        slots, lengths = st.slots[kept], out[kept, -1].astype(np.int64)
        self._upto[slots] = lengths
        self._ready_at[slots] = lengths
        self._ready_drafts[slots] = out[kept, : self._k_pow2]

    def _slot_of(self, seq_id: int) -> int:
        slot = self._slot.get(seq_id)
        if slot is None:
            if not self._free:
                self._add_rows()
            slot = self._slot[seq_id] = self._free.pop()
            self._upto[slot] = 0
            self._owner[slot] = seq_id
            self._ready_at[slot] = -1
        return slot

    def _add_rows(self) -> None:
        """Doubles the rows (at least 16)."""
        rows, width = self._hist.shape
        more = max(16, rows)
        grown = torch.zeros((rows + more, width), dtype=torch.int32, device=self.device)
        grown[:rows] = self._hist
        self._hist = grown
        self._upto = np.concatenate((self._upto, np.zeros(more, np.int64)))
        self._owner = np.concatenate((self._owner, np.full(more, -1, np.int64)))
        self._ready_at = np.concatenate((self._ready_at, np.full(more, -1, np.int64)))
        self._ready_drafts = np.concatenate(
            (self._ready_drafts, np.zeros((more, self._k_pow2), np.int32))
        )
        self._free.extend(range(rows + more - 1, rows - 1, -1))

    def _grow(self, length: int) -> None:
        """Widens the rows to hold ``length`` tokens (doubling)."""
        rows, width = self._hist.shape
        if length <= width:
            return
        while width < length:
            width *= 2
        grown = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        grown[:, : self._hist.shape[1]] = self._hist
        self._hist = grown

    def release(self, seq_ids: Iterable[int]) -> None:
        self._ids = None  # a released id may come back in another row
        self._absorb()  # before a released row can be given to another sequence
        for sid in seq_ids:
            slot = self._slot.pop(sid, None)
            if slot is not None:
                self._upto[slot] = 0
                self._owner[slot] = self._ready_at[slot] = -1
                self._free.append(slot)

    def close(self) -> None:
        self._ids = None
        self._staged = None
        self._slot.clear()
        self._free.clear()
        self._hist = torch.zeros((0, MIN_WIDTH), dtype=torch.int32, device=self.device)
        self._upto = np.zeros(0, np.int64)
        self._owner = np.zeros(0, np.int64)
        self._ready_at = np.zeros(0, np.int64)
        self._ready_drafts = np.zeros((0, self._k_pow2), np.int32)
