"""The n-gram proposer on the GPU: each sequence's tokens kept in a device buffer, the
lookup one kernel launch for the whole batch (``kvscale.kernels.ngram_match``).

The host's part of a step is what changed since the last one: the tokens each sequence
accepted (a few per sequence), written with the batch's rows and lengths into pinned host
memory that the GPU reads directly. One launch writes them into their rows and scans
every sequence's whole history (tens of microseconds for 256 sequences of 2,048 tokens),
and writes the drafts back into pinned memory: no copy to enqueue, one wait. Same rule
and the same drafts as ``NgramProposer`` (the host proposer, used on CPU).

Memory: one int32 row per running sequence, ``max_model_len`` wide at most (grown by
doubling to the longest sequence seen): 256 sequences of 8,192 tokens take 8 MiB.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, repeat
from operator import attrgetter, getitem

import numpy as np
import torch

from kvscale.server.spec_decode.ngram_proposer import check_ngram_settings
from kvscale.server.spec_decode.proposer import DraftRequest, Proposal

MIN_WIDTH = 1024  # tokens a row holds at first
_K, _SEQ_ID, _TOKENS = attrgetter("k"), attrgetter("seq_id"), attrgetter("token_ids")


class DeviceNgramProposer:
    """``Proposer`` (name "ngram") whose lookups run on ``device`` (CUDA; on CPU only
    under the Triton interpreter, for tests)."""

    name = "ngram"

    def __init__(self, k: int, min_n: int, max_n: int, device: torch.device) -> None:
        check_ngram_settings(k, min_n, max_n)
        from kvscale.kernels.ngram_match import ngram_match, pack_inputs  # triton: here only

        self._match, self._pack = ngram_match, pack_inputs
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._k_pow2 = 1 << (k - 1).bit_length()
        self.device = device
        self._hist = torch.zeros((0, MIN_WIDTH), dtype=torch.int32, device=device)
        self._slot: dict[int, int] = {}  # seq_id -> row of _hist
        self._free: list[int] = []
        self._upto = np.zeros(0, np.int64)  # per row: tokens copied to the device
        self._ids: list[int] | None = None  # the last batch's seq ids and their rows
        self._slots = np.zeros(0, np.int64)
        # The kernel's inputs and outputs live in pinned host memory, which the GPU reads
        # and writes directly: a call is one launch and one wait, no copies to enqueue.
        self._in = self._staging(64, torch.int64)
        self._out = self._staging(16 * (self._k_pow2 + 1), torch.int32)
        self._in_np, self._out_np = self._in.numpy(), self._out.numpy()

    def _staging(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.device.type == "cuda")

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Drafts of each request (point masses: q is None)."""
        b = len(requests)
        if b == 0:
            return Proposal.empty(0, 1)
        ks = np.fromiter(map(_K, requests), np.int64, count=b)
        res = Proposal.empty(b, int(ks.max()))
        ids = list(map(_SEQ_ID, requests))
        toks = list(map(_TOKENS, requests))
        length = np.fromiter(map(len, toks), np.int64, count=b)
        if ids != self._ids:  # another batch than the last: look its rows up
            self._slots = np.fromiter(map(self._slot_of, ids), np.int64, count=b)
            self._ids = ids
        slots = self._slots
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
        both = self._out_np[: b * (self._k_pow2 + 1)].reshape(b, -1)  # drafts, their number
        nums = np.where(both[:, -1] > 0, np.minimum(ks, self.k), 0)
        width = min(res.tokens.shape[1], self._k_pow2)
        keep = np.arange(width)[None, :] < nums[:, None]
        res.tokens[:, :width] = np.where(keep, both[:, :width], -1)
        res.num_tokens[:] = nums
        return res

    def _slot_of(self, seq_id: int) -> int:
        slot = self._slot.get(seq_id)
        if slot is None:
            if not self._free:
                self._add_rows()
            slot = self._slot[seq_id] = self._free.pop()
            self._upto[slot] = 0
        return slot

    def _add_rows(self) -> None:
        """Doubles the rows (at least 16)."""
        rows, width = self._hist.shape
        more = max(16, rows)
        grown = torch.zeros((rows + more, width), dtype=torch.int32, device=self.device)
        grown[:rows] = self._hist
        self._hist = grown
        self._upto = np.concatenate((self._upto, np.zeros(more, np.int64)))
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
        for sid in seq_ids:
            slot = self._slot.pop(sid, None)
            if slot is not None:
                self._upto[slot] = 0
                self._free.append(slot)

    def close(self) -> None:
        self._ids = None
        self._slot.clear()
        self._free.clear()
        self._hist = torch.zeros((0, MIN_WIDTH), dtype=torch.int32, device=self.device)
        self._upto = np.zeros(0, np.int64)
