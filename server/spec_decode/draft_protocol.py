"""The draft sidecar's wire format: length-prefixed binary frames (struct + numpy bytes).

Every frame is ``u32 body length`` then the body; a body starts with a ``u8`` kind. All
integers and floats are little-endian. Pure functions: ``encode_*`` return whole frames
(prefix included); ``frame_length`` checks a prefix, ``decode_frame`` a body; anything
malformed or truncated raises ``ProtocolError`` (a ValueError) naming what is wrong.

Kinds and bodies (after the kind byte):

- HELLO (server -> client, on accept): ``u16 version, u32 vocab_size, u16 max_k,
  u16 top_m, u16 n`` then ``n`` bytes of the tokenizer fingerprint (ASCII).
- PROPOSE (client -> server, one per step): ``u32 B, u32 T`` then ``B`` packed records
  ``(i64 seq_id, i32 keep, i32 num_new, i32 k, f32 temperature, u8 has_seed, u64 seed)``
  then ``T = sum(num_new)`` int32 tokens. ``keep``: how many of the tokens the server
  holds for the sequence stay valid (its drafts included); the new tokens follow them.
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
from itertools import chain
from typing import NamedTuple

import numpy as np

from kvscale.server.spec_decode.proposer import Proposal

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 256 << 20  # a larger length prefix is garbage, not a frame

HELLO, PROPOSE, PROPOSAL, RELEASE, ERROR = 1, 2, 3, 4, 5

PREFIX = struct.Struct("<I")
_HELLO = struct.Struct("<BHIHHH")
_PROPOSE = struct.Struct("<BII")
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
    """One sequence of a PROPOSE frame (a NamedTuple: 64 of them are built every step)."""

    seq_id: int
    keep: int
    new_tokens: Sequence[int] | np.ndarray
    k: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class ProposeFrame:
    """A decoded PROPOSE: ``records`` (``RECORD`` ``[B]``) and their new tokens."""

    records: np.ndarray
    tokens: np.ndarray  # int32 [T]
    offsets: np.ndarray  # int64 [B + 1]: sequence i's new tokens are tokens[off[i]:off[i+1]]

    def __len__(self) -> int:
        return len(self.records)

    def updates(self) -> list[SeqUpdate]:
        """The sequences, in order; ``new_tokens`` as lists of ints."""
        r = self.records
        cols = [r[name].tolist() for name in ("seq_id", "keep", "k", "temperature", "has_seed")]
        seeds, tokens, off = r["seed"].tolist(), self.tokens.tolist(), self.offsets.tolist()
        return [
            SeqUpdate(sid, keep, tokens[off[i] : off[i + 1]], k, temp, seeds[i] if has else None)
            for i, (sid, keep, k, temp, has) in enumerate(zip(*cols, strict=True))
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


def encode_propose(updates: Sequence[SeqUpdate]) -> bytes:
    """Raises ProtocolError for values the format cannot carry (negative counts, k over
    65535, token ids outside int32)."""
    b = len(updates)
    for u in updates:  # checks on plain ints and floats (cheap; numpy would wrap them)
        if u.keep < 0 or not 0 <= u.k <= 0xFFFF:
            raise ProtocolError(f"seq {u.seq_id}: keep={u.keep}, k={u.k} out of range")
        if not (0 <= u.temperature < math.inf):
            raise ProtocolError(f"seq {u.seq_id}: temperature={u.temperature}")
    rec = np.array(
        [
            (
                u.seq_id, u.keep, len(u.new_tokens), u.k, u.temperature,
                u.seed is not None, 0 if u.seed is None else int(u.seed) & _MASK64,
            )
            for u in updates
        ],
        dtype=RECORD,
    )  # fmt: skip
    flat = np.fromiter(chain.from_iterable(u.new_tokens for u in updates), dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
        bad = next(u.seq_id for u in updates if any(not 0 <= t < 2**31 for t in u.new_tokens))
        raise ProtocolError(f"seq {bad}: token ids must be in [0, 2**31)")
    tokens = flat.astype(_I32)
    head = _PROPOSE.pack(PROPOSE, b, tokens.size)
    return _frame(head + rec.tobytes() + tokens.tobytes())


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
    if b and (rec["keep"].min() < 0 or rec["num_new"].min() < 0 or rec["k"].min() < 0):
        raise ProtocolError("PROPOSE: a negative keep, token count or k")
    if b and not (np.isfinite(rec["temperature"]).all() and rec["temperature"].min() >= 0):
        raise ProtocolError("PROPOSE: a temperature is negative or not finite")
    if b and rec["has_seed"].max() > 1:
        raise ProtocolError("PROPOSE: has_seed must be 0 or 1")
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(rec["num_new"], out=offsets[1:])
    if offsets[-1] != t:
        raise ProtocolError(f"PROPOSE: token counts add up to {offsets[-1]}, the frame has {t}")
    if t and tokens.min() < 0:
        raise ProtocolError("PROPOSE: a negative token id")
    return ProposeFrame(rec, tokens, offsets)


def _decode_proposal(body: bytes) -> ProposalFrame:
    if len(body) < _PROPOSAL.size:
        raise ProtocolError("PROPOSAL: truncated header")
    _, b, k, m, us = _PROPOSAL.unpack_from(body)
    n_q = b * k * m
    _need(body, _PROPOSAL.size + 4 * (b * k + b) + 8 * n_q, "PROPOSAL")
    off = _PROPOSAL.size
    tokens = np.frombuffer(body, _I32, b * k, off).reshape(b, k).astype(np.int64)
    off += 4 * b * k
    num = np.frombuffer(body, _I32, b, off).astype(np.int64)
    off += 4 * b
    if b and (num.min() < 0 or num.max() > k):
        raise ProtocolError(f"PROPOSAL: num_tokens outside [0, {k}]")
    p = Proposal(tokens, num)
    if m:
        p.q_ids = np.frombuffer(body, _I32, n_q, off).reshape(b, k, m).copy()
        p.q_probs = np.frombuffer(body, "<f4", n_q, off + 4 * n_q).reshape(b, k, m).copy()
    return ProposalFrame(p, us / 1e6)
