"""The draft model in a sidecar process, over a Unix socket (``draft_protocol`` frames).

- ``serve_draft(runner, socket_path)``: the sidecar. One client at a time; a new
  connection replaces the old one and resets every sequence. Each PROPOSE frame gets one
  PROPOSAL frame (one round trip per step for the whole batch); RELEASE frames get no
  answer; a frame it cannot serve gets an ERROR frame and the connection is closed.
- ``SidecarProposer``: the target's client, a ``Proposer`` (name "draft"). It mirrors
  the tokens the sidecar holds per sequence and sends only ``keep`` + the new tokens.
  Once started it never raises from ``propose``: on any error or timeout it returns no
  drafts, marks itself unavailable (logged once), counts the failure and tries to
  reconnect at most every ``retry_s``; a new connection starts with an empty mirror.
  Every call returns within ``timeout_s`` (connecting included).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from kvscale.server.spec_decode.draft_protocol import (
    PREFIX,
    PROTOCOL_VERSION,
    ErrorFrame,
    Hello,
    ProposalFrame,
    ProposeFrame,
    ProtocolError,
    ReleaseFrame,
    SeqUpdate,
    decode_frame,
    encode_error,
    encode_hello,
    encode_proposal,
    encode_propose,
    encode_release,
    frame_length,
)
from kvscale.server.spec_decode.prefix import as_token_list, held_prefix_len
from kvscale.server.spec_decode.proposer import DraftRequest, Proposal

log = logging.getLogger(__name__)


def socket_path(address: str) -> str:
    """``unix:///path`` (or ``unix:/path``, or a plain path) -> ``/path``."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    if "://" in address:
        raise ValueError(f"draft sidecar address {address!r}: only unix:///path is supported")
    return address


# ---- socket I/O with a deadline ------------------------------------------------------------
def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the draft sidecar did not answer in time")
    return left


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, or TimeoutError at ``deadline`` / ConnectionError if the peer closes."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(_remaining(deadline))
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ConnectionError("the peer closed the connection" + (" mid-frame" if got else ""))
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float) -> bytes:
    """One frame's body."""
    return recv_exact(sock, frame_length(recv_exact(sock, PREFIX.size, deadline)), deadline)


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))  # sendall's timeout bounds the whole send
    sock.sendall(data)


# ---- the server ---------------------------------------------------------------------------
class DraftModel(Protocol):
    """What the sidecar serves: a DraftRunner (or a stand-in in tests)."""

    max_k: int
    top_m: int
    vocab_size: int

    def propose(self, requests: list[DraftRequest]) -> Proposal: ...
    def release(self, seq_ids: Iterable[int]) -> None: ...
    def reset(self) -> None: ...


class _Session:
    """One client's sequences: the tokens the server holds for each (the client mirrors
    them) and the runner's state."""

    def __init__(self, runner: DraftModel) -> None:
        self.runner = runner
        self.held: dict[int, list[int]] = {}
        runner.reset()

    def propose(self, frame: ProposeFrame) -> bytes:
        reqs = []
        updates = list(frame.updates())
        for u in updates:  # checked before anything is changed
            held = len(self.held.get(u.seq_id, ()))
            if u.keep > held:
                raise ProtocolError(
                    f"seq {u.seq_id}: keep={u.keep} but the server holds {held} tokens"
                )
        for u in updates:  # each list updated in place: O(new tokens) a sequence
            tokens = self.held.setdefault(u.seq_id, [])
            del tokens[u.keep :]
            tokens.extend(u.new_tokens)
            reqs.append(DraftRequest(u.seq_id, tokens, u.k, u.temperature, u.seed))
        t0 = time.perf_counter()
        p = self.runner.propose(reqs)
        compute = time.perf_counter() - t0
        drafts = p.tokens.tolist()  # one conversion, not one per row
        for r, n, row in zip(reqs, p.num_tokens.tolist(), drafts, strict=True):
            if n:
                r.token_ids.extend(row[:n])  # type: ignore[attr-defined]
        return encode_proposal(p, compute)

    def release(self, frame: ReleaseFrame) -> None:
        ids = frame.seq_ids.tolist()
        for sid in ids:
            self.held.pop(sid, None)
        self.runner.release(ids)


def _bind(path: str) -> socket.socket:
    """A listening Unix socket at ``path``; a stale socket file there is replaced, a live
    one (another sidecar answering) is an error."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise ValueError(f"{path!r} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            p.unlink()  # nobody listens: stale
        else:
            raise ValueError(f"another process is serving on {path!r}")
        finally:
            probe.close()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    return srv


def serve_draft(
    runner: DraftModel,
    socket_path: str,
    fingerprint: str,
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
    io_timeout_s: float = 30.0,
) -> None:
    """Serves ``runner`` on a Unix socket until ``stop`` is set (checked every 0.2 s).
    ``fingerprint``: the draft's tokenizer's (sent in HELLO). ``io_timeout_s``: a client
    that stops mid-frame for this long is dropped. Removes the socket file on return."""
    stop = stop or threading.Event()
    srv = _bind(socket_path)
    hello = encode_hello(
        Hello(PROTOCOL_VERSION, fingerprint, runner.vocab_size, runner.max_k, runner.top_m)
    )
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    conn: socket.socket | None = None
    session: _Session | None = None

    def drop() -> None:
        nonlocal conn, session
        if conn is not None:
            sel.unregister(conn)
            conn.close()
        conn, session = None, None

    if on_ready is not None:
        on_ready()
    try:
        while not stop.is_set():
            for key, _ in sel.select(timeout=0.2):
                if key.fileobj is srv:
                    new, _addr = srv.accept()
                    if conn is not None:
                        log.info("draft sidecar: a new client replaces the connected one")
                    drop()
                    fresh = _Session(runner)  # reset before the client hears HELLO
                    try:
                        send_all(new, hello, time.monotonic() + io_timeout_s)
                    except OSError as e:
                        log.warning("draft sidecar: handshake failed: %s", e)
                        new.close()
                        continue
                    conn, session = new, fresh
                    sel.register(conn, selectors.EVENT_READ)
                    log.info("draft sidecar: client connected")
                elif conn is not None and session is not None and key.fileobj is conn:
                    if not _serve_one(conn, session, io_timeout_s):
                        drop()
    finally:
        drop()
        sel.close()
        srv.close()
        try:
            os.unlink(socket_path)
        except OSError:
            pass


def _serve_one(conn: socket.socket, session: _Session, io_timeout_s: float) -> bool:
    """Reads and answers one frame; False when the connection should be dropped."""
    deadline = time.monotonic() + io_timeout_s
    try:
        frame = decode_frame(recv_frame(conn, deadline))
    except (OSError, ProtocolError) as e:
        if not isinstance(e, ConnectionError) or "mid-frame" in str(e):
            log.warning("draft sidecar: dropping the client: %s", e)
        else:
            log.info("draft sidecar: client disconnected")
        return False
    try:
        if isinstance(frame, ProposeFrame):
            send_all(conn, session.propose(frame), deadline)
        elif isinstance(frame, ReleaseFrame):
            session.release(frame)
        else:
            raise ProtocolError(f"a client may not send {type(frame).__name__}")
        return True
    except OSError as e:
        log.warning("draft sidecar: dropping the client: %s", e)
        return False
    except Exception as e:  # a bad request or a failing model: tell the client, start over
        log.exception("draft sidecar: cannot serve a frame")
        try:
            send_all(conn, encode_error(f"{type(e).__name__}: {e}"), deadline)
        except OSError:
            pass
        return False


# ---- the client ---------------------------------------------------------------------------
class SidecarError(RuntimeError):
    """The sidecar answered with an ERROR frame."""


class TokenizerMismatch(ValueError):
    """The sidecar's draft model has another tokenizer than the target."""


class SidecarProposer:
    """A ``Proposer`` (name "draft") whose draft model runs in a sidecar. Not thread-safe."""

    name = "draft"

    def __init__(
        self,
        address: str,
        expected_fingerprint: str | None,
        timeout_s: float = 1.0,
        retry_s: float = 1.0,
        vocab_size: int | None = None,
        wait_s: float = 0.0,
    ) -> None:
        """``address``: ``unix:///path`` or a path. ``expected_fingerprint``: the target's
        tokenizer fingerprint (None: not checked). ``timeout_s``: the most one call
        takes; ``retry_s``: the least time between two connection attempts;
        ``vocab_size``: the target's (drafts at or past it are a protocol error);
        ``wait_s``: how long the constructor keeps trying to reach a sidecar that is not
        up yet (0: one attempt; unreachable, it starts unavailable and retries later).
        ValueError if the sidecar's tokenizer differs from the target's."""
        self.path = socket_path(address)
        self.expected_fingerprint = expected_fingerprint
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.vocab_size = vocab_size
        self.available = False
        self.num_failures = 0
        self.num_reconnects = 0
        self.hello: Hello | None = None
        self.last_round_trip_s = 0.0  # wall time of the last successful propose
        self.last_server_s = 0.0  # of which the sidecar's proposer took this long
        self._sock: socket.socket | None = None
        self._last_attempt = -float("inf")
        self._connected_before = False
        self._closed = False
        self._held: dict[int, list[int]] = {}  # what the sidecar holds per sequence
        self._base: dict[int, int] = {}  # how many of those the caller sent (lcp hint)
        self._release_queue: list[int] = []
        self._warned_vocab = False
        end = time.monotonic() + wait_s
        while True:
            err = self._connect(time.monotonic() + timeout_s, at_start=True)
            if err is None or time.monotonic() + min(retry_s, 0.05) >= end:
                break
            time.sleep(min(0.05, retry_s))
        if err is not None:
            self._fail(err)

    # ---- connection -----------------------------------------------------------------------
    def _connect(self, deadline: float, at_start: bool = False) -> Exception | None:
        """Connects and checks the handshake; returns the error, None on success. A
        different tokenizer raises TokenizerMismatch (a ValueError) at start; later it is
        an error like any other."""
        self._last_attempt = time.monotonic()
        sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(_remaining(deadline))
            sock.connect(self.path)
            hello = decode_frame(recv_frame(sock, deadline))
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected HELLO, got {type(hello).__name__}")
            if hello.version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"the sidecar speaks protocol {hello.version}, this server {PROTOCOL_VERSION}"
                )
            fp = self.expected_fingerprint
            if fp is not None and hello.fingerprint != fp:
                msg = (
                    f"the draft sidecar at {self.path!r} uses another tokenizer than the "
                    f"target (fingerprint {hello.fingerprint[:12]}, vocabulary of "
                    f"{hello.vocab_size} ids, vs the target's {fp[:12]}); speculative "
                    "decoding needs a draft model with the same tokenizer"
                )
                raise TokenizerMismatch(msg)
        except Exception as e:
            if sock is not None:
                sock.close()
            if at_start and isinstance(e, TokenizerMismatch):
                raise
            return e
        self._sock, self.hello = sock, hello
        self._held.clear()
        self._base.clear()
        self._release_queue.clear()
        if self._connected_before:
            self.num_reconnects += 1
            log.info("draft sidecar at %s is back: drafting again", self.path)
        self._connected_before = True
        self.available = True
        return None

    def _fail(self, err: BaseException) -> None:
        self.num_failures += 1
        self._last_attempt = time.monotonic()  # the next attempt waits retry_s from now
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.available or self.num_failures == 1:
            log.warning(
                "draft sidecar at %s unavailable (%s: %s): no drafts; retrying every %.1fs",
                self.path, type(err).__name__, err, self.retry_s,
            )  # fmt: skip
        self.available = False

    # ---- the Proposer interface ----------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """The sidecar's drafts, or none (``Proposal.empty``) if it is unavailable, fails
        or does not answer within ``timeout_s``. Never raises."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        b, kmax = len(requests), max((r.k for r in requests), default=0)
        if self._closed or b == 0:
            return Proposal.empty(b, kmax)
        if self._sock is None:
            if t0 - self._last_attempt < self.retry_s:
                return Proposal.empty(b, kmax)
            err = self._connect(deadline)
            if err is not None:
                self._fail(err)
                return Proposal.empty(b, kmax)
        try:
            return self._round_trip(requests, b, kmax, t0, deadline)
        except Exception as e:
            self._fail(e)
            return Proposal.empty(b, kmax)

    def _round_trip(
        self, requests: list[DraftRequest], b: int, kmax: int, t0: float, deadline: float
    ) -> Proposal:
        assert self._sock is not None
        updates, sent = [], []
        for r in requests:
            toks = as_token_list(r.token_ids)
            held = self._held.get(r.seq_id, [])
            keep = held_prefix_len(held, toks, self._base.get(r.seq_id, 0))
            new = toks[keep:]
            updates.append(SeqUpdate(r.seq_id, keep, new, r.k, r.temperature, r.seed))
            sent.append((keep, new, len(toks)))
        data = encode_propose(updates)
        if self._release_queue:
            data = encode_release(self._release_queue) + data
            self._release_queue.clear()
        send_all(self._sock, data, deadline)
        reply = decode_frame(recv_frame(self._sock, deadline))
        if isinstance(reply, ErrorFrame):
            raise SidecarError(f"the sidecar refused the step: {reply.message}")
        if not isinstance(reply, ProposalFrame):
            raise ProtocolError(f"expected PROPOSAL, got {type(reply).__name__}")
        p = reply.proposal
        valid = self._check(p, requests, b, kmax)
        drafts = p.tokens.tolist()  # one conversion, not one per row
        nums = p.num_tokens.tolist()
        for i, r in enumerate(requests):  # what the sidecar now holds, updated in place
            keep, new, length = sent[i]
            held = self._held.setdefault(r.seq_id, [])
            del held[keep:]
            held.extend(new)
            if nums[i]:
                held.extend(drafts[i][: nums[i]])
            self._base[r.seq_id] = length
        self._drop_rows_past_vocab(p, valid)
        self.last_round_trip_s = time.monotonic() - t0
        self.last_server_s = reply.compute_s
        return p

    def _check(self, p: Proposal, requests: list[DraftRequest], b: int, kmax: int) -> np.ndarray:
        """ProtocolError unless the reply answers these requests with token ids >= 0;
        returns the drafted positions (bool ``[B, K]``)."""
        if p.tokens.shape != (b, kmax):
            raise ProtocolError(f"PROPOSAL of shape {p.tokens.shape} for {(b, kmax)}")
        ks = np.fromiter((r.k for r in requests), dtype=np.int64, count=b)
        if (p.num_tokens > ks).any():
            raise ProtocolError("PROPOSAL: more drafts than asked for")
        valid = np.arange(kmax)[None, :] < p.num_tokens[:, None]
        if (p.tokens[valid] < 0).any():
            raise ProtocolError("PROPOSAL: a negative draft token")
        if p.q_ids is not None and (p.q_ids[valid] < 0).any():
            raise ProtocolError("PROPOSAL: a negative id in q")
        return valid

    def _drop_rows_past_vocab(self, p: Proposal, valid: np.ndarray) -> None:
        """Rows drafting (or whose q holds) ids the target's vocabulary lacks (a draft
        model with a larger vocabulary) lose their drafts: the target could not verify
        them."""
        if self.vocab_size is None:
            return
        bad = ((p.tokens >= self.vocab_size) & valid).any(axis=1)
        if p.q_ids is not None:
            bad |= ((p.q_ids >= self.vocab_size).any(axis=2) & valid).any(axis=1)
        if bad.any():
            if not self._warned_vocab:
                self._warned_vocab = True
                log.warning(
                    "draft sidecar at %s proposes token ids >= the target's vocabulary "
                    "(%d): those sequences get no drafts (serve-draft --vocab-limit)",
                    self.path, self.vocab_size,
                )  # fmt: skip
            p.tokens[bad] = -1
            p.num_tokens[bad] = 0
            if p.q_ids is not None and p.q_probs is not None:
                p.q_ids[bad] = 0
                p.q_probs[bad] = 0.0

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forgets the sequences; the sidecar hears it with the next step's frame."""
        for sid in seq_ids:
            if self._held.pop(sid, None) is not None and self._sock is not None:
                self._release_queue.append(sid)
            self._base.pop(sid, None)

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.available = False
