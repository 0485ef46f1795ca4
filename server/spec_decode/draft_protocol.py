"""The draft sidecar's wire format: length-prefixed binary frames (struct + numpy bytes).

Every frame is ``u32 body length`` then the body; a body starts with a ``u8`` kind. All
integers and floats are little-endian. Pure functions: ``encode_*`` return whole frames
(prefix included; a PROPOSE from per-sequence ``SeqUpdate``s or, batched, from
``propose_records`` columns); ``frame_length`` checks a prefix, ``decode_frame`` a body;
anything malformed or truncated raises ``ProtocolError`` (a ValueError) naming what is
wrong.

Kinds and bodies (after the kind byte):

- HELLO (server -> client, on accept): ``u16 version, u32 vocab_size, u16 max_k,
  u16 top_m, u16 n`` then ``n`` bytes of the tokenizer fingerprint (ASCII).
- PROPOSE (client -> server, one per step): ``u32 B, u32 T`` then ``B`` packed records
  ``(i64 seq_id, i32 keep, i32 num_new, i32 k, f32 temperature, u8 has_seed, u64 seed)``
  then ``T = sum(num_new)`` int32 tokens. ``keep``: how many of the tokens the server
  holds for the sequence stay valid (its drafts included); the new tokens follow them.
  A sequence appears at most once a frame.
- PROPOSAL (server -> client, the answer): ``u32 B, u16 K, u16 M, u32 compute_us`` then
  tokens int32 ``[B, K]`` (-1 past num_tokens), num_tokens int32 ``[B]``, and when
  ``M > 0`` q_ids int32 ``[B, K, M]`` and q_probs float32 ``[B, K, M]`` (``M == 0``: no q,
  point masses). ``compute_us``: the server's time in the proposer.
- RELEASE (client -> server, no answer): ``u32 n`` then ``n`` int64 seq ids.
- ERROR (server -> client): a UTF-8 message; the server closes the connection after it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import NamedTuple

import numpy as np

from kvscale.server.spec_decode.proposer import Proposal

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 256 << 20  # a larger length prefix is garbage, not a frame

HELLO, PROPOSE, PROPOSAL, RELEASE, ERROR = 1, 2, 3, 4, 5

PREFIX = struct.Struct("<I")
_HELLO = struct.Struct("<BHIHHH")
_PROPOSE = struct.Struct("<BII")
PROPOSE_HEADER_SIZE = _PROPOSE.size  # a PROPOSE body's bytes before its records
_PROPOSAL = struct.Struct("<BIHHI")
_RELEASE = struct.Struct("<BI")
RECORD = np.dtype(
    [
        ("seq_id", "<i8"),
        ("keep", "<i4"),
        ("num_new", "<i4"),
        ("k", "<i4"),
        ("temperature", "<f4"),
        ("has_seed", "u1"),
        ("seed", "<u8"),
    ]
)  # packed: 33 bytes
_MASK64 = (1 << 64) - 1
_I32 = np.dtype("<i4")
_I32_MAX = (1 << 31) - 1


class ProtocolError(ValueError):
    """A frame that does not follow the format (or a peer that broke the protocol)."""


@dataclass(frozen=True)
class Hello:
    version: int
    fingerprint: str  # the draft's tokenizer fingerprint (tokenizer_check)
    vocab_size: int  # drafts are below it
    max_k: int  # most drafts per sequence
    top_m: int  # width of a sampled draft's q


class SeqUpdate(NamedTuple):
    """One sequence of a PROPOSE frame, for ``encode_propose`` and ``ProposeFrame.updates``
    (the client's hot path builds the records column by column instead)."""

    seq_id: int
    keep: int
    new_tokens: Sequence[int] | np.ndarray
    k: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class ProposeFrame:
    """A decoded PROPOSE: ``records`` (``RECORD`` ``[B]``) and their new tokens (int32
    ``[T]``), and the columns the server reads as Python lists (converted once, while
    checking them: ``tolist`` and the builtins are cheaper than numpy for one batch)."""

    records: np.ndarray
    tokens: np.ndarray  # int32 [T]
    offsets: list[int]  # B + 1: sequence i's new tokens are token_list[off[i]:off[i+1]]
    seq_ids: list[int]
    keep: list[int]
    k: list[int]
    temperature: list[float]  # the float32 values
    has_seed: list[int]  # 0 or 1
    token_list: list[int]  # ``tokens`` as ints

    def __len__(self) -> int:
        return len(self.records)

    def seeds(self) -> list[int | None]:
        """Each sequence's seed (None: unseeded)."""
        if not any(self.has_seed):
            return [None] * len(self.has_seed)
        raw = self.records["seed"].tolist()
        return [s if h else None for s, h in zip(raw, self.has_seed, strict=True)]

    def updates(self) -> list[SeqUpdate]:
        """The sequences, in order; ``new_tokens`` as lists of ints."""
        tokens, off = self.token_list, self.offsets
        cols = (self.seq_ids, self.keep, self.k, self.temperature, self.seeds())
        return [
            SeqUpdate(sid, keep, tokens[off[i] : off[i + 1]], k, temp, seed)
            for i, (sid, keep, k, temp, seed) in enumerate(zip(*cols, strict=True))
        ]


@dataclass
class ProposalFrame:
    proposal: Proposal  # tokens/num_tokens int64; q_ids int32, q_probs float32 or None
    compute_s: float


@dataclass(frozen=True)
class ReleaseFrame:
    seq_ids: np.ndarray  # int64 [n]


@dataclass(frozen=True)
class ErrorFrame:
    message: str


Frame = Hello | ProposeFrame | ProposalFrame | ReleaseFrame | ErrorFrame


def _frame(body: bytes) -> bytes:
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {len(body)} bytes is over the {MAX_FRAME_BYTES} limit")
    return PREFIX.pack(len(body)) + body


# ---- encoding ---------------------------------------------------------------------------
def encode_hello(h: Hello) -> bytes:
    fp = h.fingerprint.encode("ascii")
    return _frame(_HELLO.pack(HELLO, h.version, h.vocab_size, h.max_k, h.top_m, len(fp)) + fp)


def propose_records(
    seq_ids: Sequence[int] | np.ndarray,
    keep: Sequence[int] | np.ndarray,
    num_new: Sequence[int] | np.ndarray,
    k: Sequence[int] | np.ndarray,
    temperature: Sequence[float] | np.ndarray,
    seeds: Sequence[int | None],
) -> np.ndarray:
    """The ``RECORD`` ``[B]`` of a PROPOSE, built column by column (each of length ``B``;
    a seed None: unseeded, the others travel mod 2**64). Raises ProtocolError for values
    the format cannot carry, naming the sequence, the value and what is allowed."""
    b = len(seq_ids)
    rec = np.empty(b, RECORD)
    if not b:
        return rec
    try:
        rec["seq_id"] = seq_ids
    except (OverflowError, TypeError, ValueError) as e:
        bad = next((s for s in seq_ids if not -(2**63) <= int(s) < 2**63), None)
        raise ProtocolError(f"PROPOSE: seq id {bad} does not fit int64 ({e})") from e
    for name, col, hi in (
        ("keep", keep, _I32_MAX),
        ("num_new", num_new, _I32_MAX),
        ("k", k, 0xFFFF),
    ):
        try:
            arr = np.asarray(col, dtype=np.int64)
            fits = bool(arr.min() >= 0 and arr.max() <= hi)
        except OverflowError:  # a Python int past int64
            fits = False
        if not fits:
            i = next(i for i, v in enumerate(col) if not 0 <= int(v) <= hi)
            raise ProtocolError(f"seq {seq_ids[i]}: {name}={col[i]} is outside [0, {hi}]")
        rec[name] = arr
    temps = np.asarray(temperature, dtype=np.float64)
    rec["temperature"] = temps
    t32 = rec["temperature"]
    if not (t32.min() >= 0 and t32.max() < math.inf):  # a NaN fails the first
        i = int((~((temps >= 0) & np.isfinite(t32))).argmax())
        raise ProtocolError(
            f"seq {rec['seq_id'][i]}: temperature={temps[i]} must be finite and >= 0 "
            "(and fit a float32)"
        )
    if seeds.count(None) == b:  # the usual case: no seeded request
        rec["has_seed"] = 0
        rec["seed"] = 0
    else:
        rec["has_seed"] = [s is not None for s in seeds]
        rec["seed"] = [0 if s is None else int(s) & _MASK64 for s in seeds]
    return rec


def encode_propose_records(records: np.ndarray, tokens: np.ndarray) -> bytes:
    """A PROPOSE frame of ``records`` (``RECORD`` ``[B]``, e.g. from ``propose_records``)
    and their new tokens (integers ``[T]``, ``T = sum(num_new)``, in record order).
    Raises ProtocolError for counts that do not add up or token ids outside int32."""
    if records.dtype != RECORD:
        raise ValueError(f"PROPOSE records must have the RECORD dtype, got {records.dtype}")
    b, t = len(records), len(tokens)
    counted = sum(records["num_new"].tolist())
    if counted != t:
        raise ProtocolError(f"PROPOSE: the records announce {counted} new tokens, got {t}")
    if t and np.count_nonzero(tokens >> 31):  # not in [0, 2**31) (any integer dtype)
        i = int(((tokens < 0) | (tokens > _I32_MAX)).argmax())
        row = int(np.searchsorted(np.cumsum(records["num_new"]), i, side="right"))
        raise ProtocolError(
            f"seq {records['seq_id'][row]}: token id {tokens[i]} is out of range: "
            "token ids must be in [0, 2**31)"
        )
    body = (_PROPOSE.pack(PROPOSE, b, t), records.tobytes(), tokens.astype(_I32).tobytes())
    size = sum(map(len, body))
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES} limit")
    return b"".join((PREFIX.pack(size), *body))


def encode_propose(updates: Sequence[SeqUpdate]) -> bytes:
    """A PROPOSE frame of ``updates`` (the convenient, per-sequence form of
    ``propose_records`` + ``encode_propose_records``). Raises ProtocolError for values the
    format cannot carry (negative counts, k over 65535, token ids outside int32)."""
    try:
        flat = np.fromiter(chain.from_iterable(u.new_tokens for u in updates), dtype=np.int64)
    except OverflowError as e:
        bad = next(u.seq_id for u in updates if any(not 0 <= t < 2**31 for t in u.new_tokens))
        raise ProtocolError(f"seq {bad}: token ids must be in [0, 2**31)") from e
    rec = propose_records(
        [u.seq_id for u in updates],
        [u.keep for u in updates],
        [len(u.new_tokens) for u in updates],
        [u.k for u in updates],
        [u.temperature for u in updates],
        [u.seed for u in updates],
    )
    return encode_propose_records(rec, flat)


def encode_proposal(p: Proposal, compute_s: float = 0.0) -> bytes:
    b, k = p.tokens.shape
    m = 0 if p.q_ids is None else int(p.q_ids.shape[2])
    if k > 0xFFFF or m > 0xFFFF:
        raise ProtocolError(f"K={k}, M={m}: at most 65535")
    us = min(max(int(compute_s * 1e6), 0), 0xFFFFFFFF)
    parts = [
        _PROPOSAL.pack(PROPOSAL, b, k, m, us),
        np.ascontiguousarray(p.tokens, dtype=_I32).tobytes(),
        np.ascontiguousarray(p.num_tokens, dtype=_I32).tobytes(),
    ]
    if m:
        assert p.q_probs is not None
        parts.append(np.ascontiguousarray(p.q_ids, dtype=_I32).tobytes())
        parts.append(np.ascontiguousarray(p.q_probs, dtype="<f4").tobytes())
    return _frame(b"".join(parts))


def encode_release(seq_ids: Iterable[int]) -> bytes:
    ids = np.fromiter(seq_ids, dtype="<i8")
    return _frame(_RELEASE.pack(RELEASE, ids.size) + ids.tobytes())


def encode_error(message: str) -> bytes:
    return _frame(bytes([ERROR]) + message.encode("utf-8", "replace")[:65536])


# ---- decoding -------------------------------------------------------------------------
def frame_length(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; ProtocolError if it is not plausible."""
    if len(prefix) != PREFIX.size:
        raise ProtocolError(f"a frame prefix is {PREFIX.size} bytes, got {len(prefix)}")
    (n,) = PREFIX.unpack(prefix)
    if n < 1 or n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame length {n} is out of range [1, {MAX_FRAME_BYTES}]")
    return n


def split_frame(buf: bytes) -> tuple[bytes, bytes] | None:
    """``(body, rest)`` of the first whole frame in ``buf``, None if it is incomplete."""
    if len(buf) < PREFIX.size:
        return None
    n = frame_length(buf[: PREFIX.size])
    end = PREFIX.size + n
    return (buf[PREFIX.size : end], buf[end:]) if len(buf) >= end else None


def _need(body: bytes, n: int, what: str) -> None:
    if len(body) != n:
        raise ProtocolError(f"{what}: the body is {len(body)} bytes, expected {n}")


def decode_frame(body: bytes) -> Frame:
    """Decodes one frame body (after its length prefix)."""
    if not body:
        raise ProtocolError("an empty frame")
    kind = body[0]
    if kind == HELLO:
        return _decode_hello(body)
    if kind == PROPOSE:
        return _decode_propose(body)
    if kind == PROPOSAL:
        return _decode_proposal(body)
    if kind == RELEASE:
        if len(body) < _RELEASE.size:
            raise ProtocolError("RELEASE: truncated header")
        _, n = _RELEASE.unpack_from(body)
        _need(body, _RELEASE.size + 8 * n, "RELEASE")
        return ReleaseFrame(np.frombuffer(body, "<i8", n, _RELEASE.size).astype(np.int64))
    if kind == ERROR:
        return ErrorFrame(body[1:].decode("utf-8", "replace"))
    raise ProtocolError(f"unknown frame kind {kind}")


def _decode_hello(body: bytes) -> Hello:
    if len(body) < _HELLO.size:
        raise ProtocolError("HELLO: truncated header")
    _, version, vocab, max_k, top_m, n = _HELLO.unpack_from(body)
    _need(body, _HELLO.size + n, "HELLO")
    try:
        fp = body[_HELLO.size :].decode("ascii")
    except UnicodeDecodeError as e:
        raise ProtocolError("HELLO: the fingerprint is not ASCII") from e
    return Hello(version, fp, vocab, max_k, top_m)


def _decode_propose(body: bytes) -> ProposeFrame:
    if len(body) < _PROPOSE.size:
        raise ProtocolError("PROPOSE: truncated header")
    _, b, t = _PROPOSE.unpack_from(body)
    _need(body, _PROPOSE.size + b * RECORD.itemsize + 4 * t, "PROPOSE")
    rec = np.frombuffer(body, RECORD, b, _PROPOSE.size)
    tokens = np.frombuffer(body, _I32, t, _PROPOSE.size + b * RECORD.itemsize)
    keep, num, k = rec["keep"].tolist(), rec["num_new"].tolist(), rec["k"].tolist()
    temp, has = rec["temperature"].tolist(), rec["has_seed"].tolist()
    token_list = tokens.tolist()
    if b:  # checked on lists: the builtins beat numpy's reductions at this size
        if min(keep) < 0 or min(num) < 0 or min(k) < 0:
            raise ProtocolError("PROPOSE: a negative keep, token count or k")
        if not (math.isfinite(sum(temp)) and min(temp) >= 0):  # NaN, inf: not finite
            raise ProtocolError("PROPOSE: a temperature is negative or not finite")
        if max(has) > 1:
            raise ProtocolError("PROPOSE: has_seed must be 0 or 1")
    offsets = list(accumulate(num, initial=0))
    if offsets[-1] != t:
        raise ProtocolError(f"PROPOSE: token counts add up to {offsets[-1]}, the frame has {t}")
    if t and min(token_list) < 0:
        raise ProtocolError("PROPOSE: a negative token id")
    return ProposeFrame(
        rec, tokens, offsets, rec["seq_id"].tolist(), keep, k, temp, has, token_list
    )


def _decode_proposal(body: bytes) -> ProposalFrame:
    if len(body) < _PROPOSAL.size:
        raise ProtocolError("PROPOSAL: truncated header")
    _, b, k, m, us = _PROPOSAL.unpack_from(body)
    n_q = b * k * m
    _need(body, _PROPOSAL.size + 4 * (b * k + b) + 8 * n_q, "PROPOSAL")
    off = _PROPOSAL.size
    tokens = np.frombuffer(body, _I32, b * k, off).reshape(b, k).astype(np.int64)
    off += 4 * b * k
    num32 = np.frombuffer(body, _I32, b, off)
    off += 4 * b
    nums = num32.tolist()
    if b and (min(nums) < 0 or max(nums) > k):
        raise ProtocolError(f"PROPOSAL: num_tokens outside [0, {k}]")
    num = num32.astype(np.int64)
    p = Proposal(tokens, num)
    if m:
        p.q_ids = np.frombuffer(body, _I32, n_q, off).reshape(b, k, m).copy()
        p.q_probs = np.frombuffer(body, "<f4", n_q, off + 4 * n_q).reshape(b, k, m).copy()
    return ProposalFrame(p, us / 1e6)
