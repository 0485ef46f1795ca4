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

A step's cost beyond the draft model (batch 64, k = 4; budget 0.3 ms on loopback) is kept
off per-sequence Python: the per-step work of both sides is compiled C when it can be
built (``sidecar_native.c``: the client's frame and mirror in one call, its answer in
another; the sidecar's decoding and token update), else arrays and numpy (``_Mirror``:
one pass slices the token lists, numpy compares the whole batch with the drafts; frames
built and read column by column), with the same results. The bookkeeping that can wait
(the server's drafts) runs while the peer works, sockets are non-blocking (one system
call a read or write), and each side polls for the other's next frame for a short window
instead of sleeping (waking a process costs more than the rest of the round trip on a
virtual machine; the window turns itself off while it does not pay).
"""

from __future__ import annotations

import logging
import math
import os
import select
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable
from itertools import chain, repeat
from operator import attrgetter, gt
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np

from kvscale.server import native_build
from kvscale.server.spec_decode.draft_protocol import (
    PREFIX,
    PROPOSE,
    PROPOSE_HEADER_SIZE,
    PROTOCOL_VERSION,
    RECORD,
    ErrorFrame,
    Frame,
    Hello,
    ProposalFrame,
    ProposeFrame,
    ProtocolError,
    ReleaseFrame,
    decode_frame,
    encode_error,
    encode_hello,
    encode_proposal,
    encode_propose_records,
    encode_release,
    frame_length,
    propose_records,
)
from kvscale.server.spec_decode.proposer import DraftRequest, Proposal

log = logging.getLogger(__name__)

_PROPOSE_KIND = bytes([PROPOSE])
_KEY = attrgetter("seq_id", "temperature", "seed")  # a request's, but for k (which varies)
_K = attrgetter("k")


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
# Sockets are used non-blocking: a read or write that can go on at once costs one system
# call, and only one that cannot waits (poll) until the deadline.
def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the draft sidecar did not answer in time")
    return left


def _nonblocking(sock: socket.socket) -> None:
    if sock.gettimeout() != 0.0:
        sock.setblocking(False)


def _wait(sock: socket.socket, event: int, deadline: float) -> None:
    """Sleeps until ``sock`` is ready for ``event`` (``select.POLLIN``/``POLLOUT``: an
    error or a hang-up counts as ready: the next call reports it); TimeoutError at
    ``deadline``."""
    poller = select.poll()
    poller.register(sock, event)
    while not poller.poll(math.ceil(_remaining(deadline) * 1000)):
        pass


class FrameReader:
    """Frames from a socket, reading whatever has arrived (a frame usually takes one
    call) and keeping what follows a frame for the next one."""

    def __init__(self, sock: socket.socket) -> None:
        _nonblocking(sock)
        self.sock = sock
        self.buf = bytearray()

    def has_frame(self) -> bool:
        """Whether a whole frame (or a bad length prefix: ``read`` raises) is buffered."""
        buf = self.buf
        if len(buf) < PREFIX.size:
            return False
        try:
            return len(buf) >= PREFIX.size + frame_length(bytes(buf[: PREFIX.size]))
        except ProtocolError:
            return True

    def read(self, deadline: float) -> bytes:
        """The next frame's body, or TimeoutError at ``deadline`` / ConnectionError if the
        peer closes / ProtocolError for a bad length prefix."""
        buf, sock = self.buf, self.sock
        need = PREFIX.size
        while True:
            if len(buf) >= PREFIX.size:
                need = PREFIX.size + frame_length(bytes(buf[: PREFIX.size]))
                if len(buf) >= need:
                    body = bytes(buf[PREFIX.size : need])
                    del buf[:need]
                    return body
            try:
                chunk = sock.recv(max(need - len(buf), 1 << 16))
            except BlockingIOError:
                _wait(sock, select.POLLIN, deadline)
                continue
            if not chunk:
                raise ConnectionError(
                    "the peer closed the connection" + (" mid-frame" if buf else "")
                )
            if not buf and len(chunk) >= PREFIX.size:  # the usual case: exactly one frame
                need = PREFIX.size + frame_length(chunk[: PREFIX.size])
                if len(chunk) == need:
                    return chunk[PREFIX.size :]
            buf += chunk
            if len(buf) < need:
                _remaining(deadline)


# Waiting by polling (a busy loop) rather than sleeping: waking a sleeping process costs
# 0.05 to 1 ms (a virtual machine: more than the whole round trip). Polling pays only if
# the peer answers within the window, and only while the CPU is not wanted elsewhere (on
# a busy machine the scheduler favours sleepers: a polling process waits for whole time
# slices, and takes them from its peer). So a window that runs out, or a loop that finds
# it lost the CPU for a while, turns polling off for a while.
SPIN_PREEMPTED_S = 0.0005  # a gap this long between two looks: the CPU went to another task
SPIN_BACKOFF_S = 0.05  # then no polling for this long
# The client also polls through the sidecar's own compute time of the last step (its
# draft model's forwards: a GPU draft takes milliseconds, so a fixed window lapses and
# the answer then waits for a wake-up), up to this long: a slower draft is a CPU one,
# whose cores a polling client would take.
SPIN_MAX_S = 0.02


def spin_window(spin_s: float, last_compute_s: float) -> float:
    """Seconds the client polls for an answer: ``spin_s`` past the sidecar's compute time
    of the last step (with a quarter's margin), that time left out past ``SPIN_MAX_S``."""
    return spin_s + (1.25 * last_compute_s if last_compute_s < SPIN_MAX_S else 0.0)


def spin_until_readable(sock: socket.socket, until: float) -> bool | None:
    """Polls ``sock`` without sleeping until it has data (True) or ``until`` passes
    (False); None if the loop lost the CPU to another task (stop polling for a while)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poll, now, pass_cpu = poller.poll, time.monotonic, os.sched_yield
    last = now()
    while not poll(0):
        t = now()
        if t >= until:
            return False
        if t - last > SPIN_PREEMPTED_S:
            return None
        pass_cpu()  # whoever else waits for this CPU runs first
        last = now()
    return True


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Sends all of ``data``, or TimeoutError at ``deadline``."""
    _nonblocking(sock)
    try:
        sent = sock.send(data)  # the usual case: all of it at once
    except BlockingIOError:
        sent = 0
    view = memoryview(data)
    while sent < len(data):
        _wait(sock, select.POLLOUT, deadline)
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            pass


# ---- the server ---------------------------------------------------------------------------
class DraftModel(Protocol):
    """What the sidecar serves: a DraftRunner (or a stand-in in tests). The requests
    ``propose`` gets, and their token lists, are the sidecar's: updated in place from one
    step to the next (read them during the call, keep copies)."""

    max_k: int
    top_m: int
    vocab_size: int

    def propose(self, requests: list[DraftRequest]) -> Proposal: ...
    def release(self, seq_ids: Iterable[int]) -> None: ...
    def reset(self) -> None: ...


class _Session:
    """One client's sequences: the tokens the server holds for each (its accepted tokens,
    then its drafts; the client mirrors them) and the runner's state.

    Each sequence keeps one ``DraftRequest`` whose ``token_ids`` list is what the server
    holds; a step updates them in place (a slice assignment a sequence, then its drafts
    appended): its cost is that of the new tokens, not of the sequences. The batch of the
    last step (its requests, their lists, their parameters) is kept too: an engine sends
    the same batch step after step, which then costs no lookups."""

    def __init__(self, runner: DraftModel) -> None:
        self.runner = runner
        self.native = native_module()  # the token update in compiled code, if built
        self.requests: dict[int, DraftRequest] = {}
        self._ids: list[int] | None = None  # the last batch: seq ids, requests, lists,
        self._reqs: list[DraftRequest] = []
        self._held: list[list[int]] = []
        self._k: list[int] | None = None  # and their parameters
        self._temperature: list[float] | None = None
        self._seeds: tuple[list[int], list[int]] | None = None  # has_seed, seed
        self._drafts: Proposal | None = None  # the last step's, until ``settle``
        runner.reset()

    def _batch(self, ids: list[int], keeps: list[int]) -> None:
        """Looks up (or creates) the batch's requests; ProtocolError before any change if
        a sequence appears twice or keeps more tokens than the server holds."""
        unique = set(ids)
        if len(unique) != len(ids):
            dup = next(s for i, s in enumerate(ids) if s in ids[:i])
            raise ProtocolError(f"PROPOSE: seq {dup} appears twice (one record a sequence)")
        fresh = {s: DraftRequest(s, [], 0) for s in unique.difference(self.requests)}
        get = self.requests.get
        reqs = [get(s) or fresh[s] for s in ids]
        held: list[list[int]] = [r.token_ids for r in reqs]  # type: ignore[misc]
        self._check_keep(ids, keeps, held)
        self.requests.update(fresh)
        self._ids, self._reqs, self._held = ids, reqs, held
        self._k = self._temperature = self._seeds = None

    @staticmethod
    def _check_keep(ids: list[int], keeps: list[int], held: list[list[int]]) -> None:
        if any(map(gt, keeps, map(len, held))):
            i = next(i for i, (kp, h) in enumerate(zip(keeps, held, strict=True)) if kp > len(h))
            raise ProtocolError(
                f"seq {ids[i]}: keep={keeps[i]} but the server holds {len(held[i])} tokens "
                "(keep must be at most that)"
            )

    def propose(self, frame: ProposeFrame) -> bytes:
        """The PROPOSAL answering ``frame`` (``settle`` once it is sent)."""
        self.settle()
        ids, keeps = frame.seq_ids, frame.keep
        if ids == self._ids:  # the same batch as last step
            self._check_keep(ids, keeps, self._held)
        else:
            self._batch(ids, keeps)
        reqs, held = self._reqs, self._held
        tokens, off = frame.token_list, frame.offsets
        if self.native is not None:
            self.native.apply_tokens(held, keeps, tokens, off)
        else:
            for h, kp, a, e in zip(held, keeps, off, off[1:], strict=False):  # off: B + 1
                h[kp:] = tokens[a:e]
        # the parameters that changed (an engine adapts k step by step): C-level loops
        if frame.k != self._k:
            any(map(setattr, reqs, repeat("k"), frame.k))
            self._k = frame.k
        if frame.temperature != self._temperature:
            any(map(setattr, reqs, repeat("temperature"), frame.temperature))
            self._temperature = frame.temperature
        seeds = (frame.has_seed, frame.records["seed"].tolist() if any(frame.has_seed) else [])
        if seeds != self._seeds:
            any(map(setattr, reqs, repeat("seed"), frame.seeds()))
            self._seeds = seeds
        t0 = time.perf_counter()
        p = self.runner.propose(reqs)
        compute = time.perf_counter() - t0
        self._drafts = p
        return encode_proposal(p, compute)

    def settle(self) -> None:
        """Appends the last step's drafts to the sequences' lists: the server holds them.
        Called once the answer is sent: off the round trip's path."""
        p, self._drafts = self._drafts, None
        if p is None:
            return
        nums, drafts = p.num_tokens.tolist(), p.tokens.tolist()
        if nums.count(p.tokens.shape[1]) == len(nums):  # every row drafted all K
            any(map(list.extend, self._held, drafts))
        else:
            for h, n, row in zip(self._held, nums, drafts, strict=True):
                if n:
                    h += row[:n]

    def release(self, frame: ReleaseFrame) -> None:
        self.settle()
        ids = frame.seq_ids.tolist()
        for sid in ids:
            self.requests.pop(sid, None)
        self._ids = None  # a released id may come back: look the batch up again
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
    spin_s: float = 0.002,
) -> None:
    """Serves ``runner`` on a Unix socket until ``stop`` is set (checked every 0.2 s).
    ``fingerprint``: the draft's tokenizer's (sent in HELLO). ``io_timeout_s``: a client
    that stops mid-frame for this long is dropped. ``spin_s``: after each frame the
    sidecar polls for the next one without sleeping for this long (an engine's next step
    usually comes sooner; waking a process that sleeps costs 0.05 to 1 ms, more than the
    whole round trip on a virtual machine), at the cost of a busy CPU core meanwhile.
    Removes the socket file on return."""
    stop = stop or threading.Event()
    srv = _bind(socket_path)
    hello = encode_hello(
        Hello(PROTOCOL_VERSION, fingerprint, runner.vocab_size, runner.max_k, runner.top_m)
    )
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    conn: socket.socket | None = None
    reader: FrameReader | None = None
    session: _Session | None = None

    def drop() -> None:
        nonlocal conn, reader, session
        if conn is not None:
            sel.unregister(conn)
            conn.close()
        conn, reader, session = None, None, None

    if on_ready is not None:
        on_ready()
    spin_until = last_look = no_spin_until = 0.0  # polling for the next frame (see above)
    try:
        while not stop.is_set():
            now = time.monotonic()
            spinning = conn is not None and now < spin_until
            if (spin_until and not spinning) or (spinning and now - last_look > SPIN_PREEMPTED_S):
                # no frame within the window, or the CPU went to another task meanwhile
                spinning, spin_until, no_spin_until = False, 0.0, now + SPIN_BACKOFF_S
            if spinning:
                os.sched_yield()  # whoever else waits for this CPU runs first
                last_look = time.monotonic()
            for key, _ in sel.select(timeout=0 if spinning else 0.2):
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
                    conn, reader, session = new, FrameReader(new), fresh
                    sel.register(conn, selectors.EVENT_READ)
                    log.info("draft sidecar: client connected")
                elif reader is not None and session is not None and key.fileobj is conn:
                    ok = _serve_one(reader, session, io_timeout_s)
                    while ok and reader.has_frame():  # frames sent together (RELEASE, PROPOSE)
                        ok = _serve_one(reader, session, io_timeout_s)
                    if not ok:
                        drop()
                    last_look = time.monotonic()
                    if last_look >= no_spin_until:
                        spin_until = last_look + spin_s
    finally:
        drop()
        sel.close()
        srv.close()
        try:
            os.unlink(socket_path)
        except OSError:
            pass


def decode(body: bytes, native: ModuleType | None) -> Frame:
    """``decode_frame``, a PROPOSE through the compiled decoder when ``native`` is set."""
    if native is None or body[:1] != _PROPOSE_KIND:
        return decode_frame(body)
    try:
        ids, keep, k, temperature, has_seed, offsets, tokens = native.decode_propose(body)
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    b = len(ids)
    records = np.frombuffer(body, RECORD, b, PROPOSE_HEADER_SIZE)
    arr = np.frombuffer(body, np.int32, len(tokens), PROPOSE_HEADER_SIZE + b * RECORD.itemsize)
    return ProposeFrame(records, arr, offsets, ids, keep, k, temperature, has_seed, tokens)


def _serve_one(reader: FrameReader, session: _Session, io_timeout_s: float) -> bool:
    """Reads and answers one frame; False when the connection should be dropped."""
    deadline = time.monotonic() + io_timeout_s
    conn = reader.sock
    try:
        frame = decode(reader.read(deadline), session.native)
    except (OSError, ProtocolError) as e:
        if not isinstance(e, ConnectionError) or "mid-frame" in str(e):
            log.warning("draft sidecar: dropping the client: %s", e)
        else:
            log.info("draft sidecar: client disconnected")
        return False
    try:
        if isinstance(frame, ProposeFrame):
            send_all(conn, session.propose(frame), deadline)
            session.settle()  # while the client reads the answer
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


def native_module() -> ModuleType | None:
    """``sidecar_native.c`` built (``native_build``), or None: the Python path."""
    return native_build.load("sidecar_native", Path(__file__).with_name("sidecar_native.c"))


_PAD = np.iinfo(np.int64).max  # past a row's drafts: equal to no token
_PAD64 = np.int64(_PAD)


def _drop_rows_past_vocab(p: Proposal, valid: np.ndarray, vocab_size: int | None) -> bool:
    """Rows drafting (or whose q holds) ids the target's vocabulary lacks (a draft
    model with a larger vocabulary) lose their drafts: the target could not verify
    them. Returns whether any did."""
    if vocab_size is None:
        return False
    if p.tokens.max(initial=-1) < vocab_size and (
        p.q_ids is None or p.q_ids.max(initial=-1) < vocab_size
    ):  # the usual case: one look at the whole batch
        return False
    bad = ((p.tokens >= vocab_size) & valid).any(axis=1)
    if p.q_ids is not None:
        bad |= ((p.q_ids >= vocab_size).any(axis=2) & valid).any(axis=1)
    if not bad.any():
        return False
    p.tokens[bad] = -1
    p.num_tokens[bad] = 0
    if p.q_ids is not None and p.q_probs is not None:
        p.q_ids[bad] = 0
        p.q_probs[bad] = 0.0
    return True


class _Mirror:
    """What the sidecar holds per sequence, as the client sees it: the caller's first
    ``base`` tokens (the whole list it sent last step), then the drafts. Accepted tokens
    are final (the ``Proposer`` contract), so a step compares only the token at
    ``base - 1`` (a replaced sequence fails to match it: all its tokens are sent again)
    and the drafts with the caller's tokens from there on.

    Per sequence, in arrays: ``base`` and ``expect`` (int64 ``[W]``): what the caller's
    tokens from ``max(base - 1, 0)`` on should start with: the token at ``base - 1`` (if
    ``base`` > 0), the drafts, then ``_PAD`` (at least once: every comparison stops).
    They live in slots (one a sequence) and, for the last batch, in batch order
    (``rows_*``): the same batch again (an engine's usual step) touches no slot. A step
    is one pass over the token lists and a few numpy ops for the whole batch."""

    def __init__(self, capacity: int = 64, width: int = 6, native: bool = True) -> None:
        # the compiled step and answer (``sidecar_native.c``): the same results as the
        # Python path below, at a few percent of its cost on a virtual machine's host
        self.native = native_module() if native else None
        self._full = np.ones((0, 0), bool)  # all drafted: the usual answer's positions
        self.slot: dict[int, int] = {}  # seq_id -> its slot
        self.free: list[int] = []
        self.used = 0  # slots [0, used) have been handed out
        self.base = np.zeros(capacity, np.int64)
        self.expect = np.full((capacity, width), _PAD, np.int64)
        self.cols = np.arange(width)
        self.ids: list[int] | None = None  # the last batch, while its rows_* are current
        self.sl = np.zeros(0, np.intp)  # its slots
        self._rows(np.zeros(0, np.int64), self.expect[:0])
        # the last step's flat tokens, row ends and lengths, for ``commit``
        self._sent = (self.base[:0], self.base[:0], self.base[:0])

    def _rows(self, base: np.ndarray, expect: np.ndarray) -> None:
        """The batch's state, and what the next step derives from ``base``."""
        self.rows_base, self.rows_expect = base, expect
        self.rows_chk = base > 0  # rows whose tokens from ``start`` begin with a check
        self.rows_start = base - self.rows_chk  # max(base - 1, 0)
        self.starts: list[int] = self.rows_start.tolist()

    def reset(self) -> None:
        self.slot.clear()
        self.free.clear()
        self.used = 0
        self.ids = None

    def forget(self, seq_ids: Iterable[int]) -> list[int]:
        """Frees the sequences' slots; returns those that had one."""
        self._flush()  # the batch's rows first: a freed slot may be handed out again
        gone = []
        for sid in seq_ids:
            slot = self.slot.pop(sid, None)
            if slot is not None:
                self.free.append(slot)
                gone.append(sid)
        return gone

    def _flush(self) -> None:
        """Writes the last batch's rows back to its slots."""
        if self.ids is not None:
            self.base[self.sl] = self.rows_base
            self.expect[self.sl] = self.rows_expect
            self.ids = None

    def _alloc(self, seq_id: int) -> int:
        if self.free:
            slot = self.free.pop()
        else:
            slot, self.used = self.used, self.used + 1
            if slot == len(self.base):
                self.base = np.resize(self.base, 2 * slot)
                self.expect = np.resize(self.expect, (2 * slot, self.expect.shape[1]))
        self.slot[seq_id] = slot
        self.base[slot] = 0
        self.expect[slot] = _PAD
        return slot

    def _gather(self, seq_ids: list[int]) -> None:
        """Makes ``seq_ids`` the batch: its slots (new sequences get one) and rows."""
        self._flush()
        get = self.slot.get
        slots = [get(s, -1) for s in seq_ids]
        if -1 in slots:  # new sequences (a duplicate may get one earlier in this loop)
            for i, s in enumerate(slots):
                if s < 0:
                    slots[i] = get(seq_ids[i], -1)
                    if slots[i] < 0:
                        slots[i] = self._alloc(seq_ids[i])
        self.sl = np.array(slots, dtype=np.intp)
        self.rows_base, self.rows_expect = self.base[self.sl], self.expect[self.sl]
        self.ids = seq_ids

    def frame(self, seq_ids: list[int], requests: list[DraftRequest], records: np.ndarray) -> bytes:
        """The PROPOSE frame of a step (``records``: its ``RECORD [B]``; ``keep`` and
        ``num_new`` are this function's), then ``commit`` once it is sent."""
        if self.native is None:
            keep, num_new, new = self.step(seq_ids, requests)
            records["keep"] = keep
            records["num_new"] = num_new
            return encode_propose_records(records, new)
        if seq_ids != self.ids:
            self._gather(seq_ids)
        if type(requests) is not list:
            requests = list(requests)
        try:  # commits as it builds the frame: a failure resets the mirror anyway
            return self.native.propose_frame(requests, self.rows_base, self.rows_expect, records)
        except (ValueError, OverflowError, TypeError) as e:
            raise ProtocolError(f"PROPOSE: {e}") from None

    def step(
        self, seq_ids: list[int], requests: list[DraftRequest]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``keep`` and ``num_new`` (int64 ``[B]``) and the new tokens to send (int64
        ``[T]``, in batch order) for the requests' token lists now (then ``commit``)."""
        if seq_ids != self.ids:
            self._gather(seq_ids)
            self._rows(self.rows_base, self.rows_expect)
        cols = self.cols
        while True:
            rows = [r.token_ids[s:] for r, s in zip(requests, self.starts, strict=True)]
            lens = np.fromiter(map(len, rows), np.int64, len(rows))
            # all rows' tokens in one array (then fillers, no token id: reads past the end)
            flat = np.fromiter(chain(chain.from_iterable(rows), (-2,) * len(cols)), np.int64)
            ends = np.add.accumulate(lens)
            at = ends - lens
            # leading tokens equal to what the sidecar holds: the check token (0: a
            # replaced or shrunk sequence), then the drafts the caller accepted (a PAD
            # stops the count; what it reads past a row's tokens, the clamp drops)
            same = flat[np.add.outer(at, cols)] == self.rows_expect
            lead = np.minimum(same.argmin(axis=1), lens)
            if not np.count_nonzero(lead < self.rows_chk):
                break
            replaced = lead < self.rows_chk
            self.rows_expect[replaced] = _PAD
            self._rows(np.where(replaced, 0, self.rows_base), self.rows_expect)
        first = at + lead  # each row's first token to send
        m = int(ends[-1]) if len(ends) else 0
        new = flat[:m][np.arange(m) >= first.repeat(lens)]
        self._sent = (flat, ends, lens)
        return self.rows_base + lead - self.rows_chk, ends - first, new

    def commit(self) -> None:
        """Records that the sidecar holds each whole list the last ``step`` saw (then the
        drafts, with ``drafted``). Work for the wait for the answer."""
        if self.native is not None:
            return  # ``frame`` did
        flat, ends, lens = self._sent
        n = self.rows_start + lens
        # the last token, for the next check (rows with no tokens: none, nothing held)
        self.rows_expect[:, 0] = np.where(n > 0, flat[ends - 1], _PAD)
        self._rows(n, self.rows_expect)

    def drafted(self, tokens: np.ndarray) -> None:
        """Records the drafts the sidecar appended to the last step's batch: int64
        ``[B, K]``, ``_PAD`` past each row's drafts."""
        k = tokens.shape[1]
        self.widen(k)
        # a row with no tokens (no check) would hold [drafts...]: comparing is not worth it
        self.rows_expect[:, 1 : k + 1] = tokens
        self.rows_expect[:, k + 1 :] = _PAD

    def widen(self, k: int) -> None:
        """Room for ``k`` drafts a row: a PAD column after them stops every comparison."""
        w = self.rows_expect.shape[1]
        if k + 2 > w:
            ids = self.ids
            self._flush()
            grown = np.full((len(self.expect), k + 2), _PAD, np.int64)
            grown[:, :w] = self.expect
            self.expect, self.cols = grown, np.arange(k + 2)
            self._gather(ids or [])
            self._rows(self.rows_base, self.rows_expect)

    def answer(
        self, body: bytes, ks: list[int], vocab_size: int | None
    ) -> tuple[Proposal, float, bool]:
        """(the drafts, the sidecar's compute seconds, whether rows lost their drafts to
        ids past ``vocab_size``) of the answer to a step whose requests asked for ``ks``
        drafts, recorded as what the sidecar holds (``drafted``). SidecarError for an ERROR
        frame, ProtocolError for anything but a valid PROPOSAL."""
        if self.native is not None:
            self.widen(max(ks, default=0))
            vocab = -1 if vocab_size is None else vocab_size
            try:
                got = self.native.parse_proposal(body, ks, self.rows_expect, vocab)
            except (ValueError, OverflowError) as e:
                raise ProtocolError(str(e)) from None
            if got is not None:
                tokens, num, q_ids, q_probs, us, dropped = got
                return Proposal(tokens, num, q_ids, q_probs), us / 1e6, dropped
        reply = decode_frame(body)  # the Python path, or not a PROPOSAL
        if isinstance(reply, ErrorFrame):
            raise SidecarError(f"the sidecar refused the step: {reply.message}")
        if not isinstance(reply, ProposalFrame):
            raise ProtocolError(f"expected PROPOSAL, got {type(reply).__name__}")
        p = reply.proposal
        valid, drafts = self._check(p, ks)
        self.drafted(drafts)  # what the sidecar now holds
        return p, reply.compute_s, _drop_rows_past_vocab(p, valid, vocab_size)

    def _check(self, p: Proposal, ks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """ProtocolError unless ``p`` answers requests asking for ``ks`` drafts with token
        ids >= 0. Returns the drafted positions (bool ``[B, K]``) and the drafts (int64
        ``[B, K]``, ``_PAD`` elsewhere)."""
        b, kmax = len(ks), max(ks, default=0)
        if p.tokens.shape != (b, kmax):
            raise ProtocolError(f"PROPOSAL of shape {p.tokens.shape} for {(b, kmax)}")
        nums = p.num_tokens.tolist()
        if any(map(gt, nums, ks)):
            raise ProtocolError("PROPOSAL: more drafts than asked for")
        if nums.count(kmax) == b:  # every row drafted K (the usual case): all valid
            valid, drafts = self._all_valid(b, kmax), p.tokens
        else:
            valid = np.arange(kmax) < p.num_tokens[:, None]
            drafts = np.where(valid, p.tokens, _PAD64)
        if b and kmax and drafts.min() < 0:
            raise ProtocolError("PROPOSAL: a negative draft token")
        if p.q_ids is not None and p.q_ids.min(initial=0) < 0:  # any at a drafted position?
            if np.count_nonzero((p.q_ids < 0).any(axis=2) & valid):
                raise ProtocolError("PROPOSAL: a negative id in q")
        return valid, drafts

    def _all_valid(self, b: int, k: int) -> np.ndarray:
        """A read-only bool ``[b, k]`` of True."""
        if self._full.shape != (b, k):
            self._full = np.ones((b, k), bool)
            self._full.flags.writeable = False
        return self._full


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
        spin_s: float = 0.001,
    ) -> None:
        """``address``: ``unix:///path`` or a path. ``expected_fingerprint``: the target's
        tokenizer fingerprint (None: not checked). ``timeout_s``: the most one call
        takes; ``retry_s``: the least time between two connection attempts;
        ``vocab_size``: the target's (drafts at or past it are a protocol error);
        ``wait_s``: how long the constructor keeps trying to reach a sidecar that is not
        up yet (0: one attempt; unreachable, it starts unavailable and retries later);
        ``spin_s``: how long a step polls for the answer before it sleeps (waking a
        process costs 0.05 to 1 ms: more than a whole round trip on a virtual machine),
        beyond the sidecar's compute time of the last step when that is under
        ``SPIN_MAX_S``.
        ValueError if the sidecar's tokenizer differs from the target's."""
        self.path = socket_path(address)
        self.expected_fingerprint = expected_fingerprint
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.vocab_size = vocab_size
        self.spin_s = spin_s
        self._no_spin_until = 0.0
        self.available = False
        self.num_failures = 0
        self.num_reconnects = 0
        self.hello: Hello | None = None
        self.last_round_trip_s = 0.0  # wall time of the last successful propose
        self.last_server_s = 0.0  # of which the sidecar's proposer took this long
        self.last_wait_s = 0.0  # of which from the request sent to the answer read
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._last_attempt = -float("inf")
        self._connected_before = False
        self._closed = False
        self._mirror = _Mirror()  # what the sidecar holds per sequence
        # the last batch: its seq ids, k, (seq_id, temperature, seed) and PROPOSE records
        self._ids: list[int] = []
        self._ks: list[int] = []
        self._key: list[tuple[int, float, int | None]] | None = None
        self._records = np.zeros(0, RECORD)
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
            reader = FrameReader(sock)
            hello = decode_frame(reader.read(deadline))
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
        self._sock, self._reader, self.hello = sock, reader, hello
        self._mirror.reset()
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
            self._sock, self._reader = None, None
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
        ks = list(map(_K, requests))
        b, kmax = len(requests), max(ks, default=0)
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
            return self._round_trip(requests, ks, t0, deadline)
        except Exception as e:
            self._fail(e)
            return Proposal.empty(b, kmax)

    def _round_trip(
        self, requests: list[DraftRequest], ks: list[int], t0: float, deadline: float
    ) -> Proposal:
        assert self._sock is not None and self._reader is not None
        b = len(requests)
        key = list(map(_KEY, requests))
        if key != self._key:  # another batch, or other parameters: new records
            ids, temps, seeds = (list(c) for c in zip(*key, strict=True))
            zero = np.zeros(b, np.int64)
            self._records = propose_records(ids, zero, zero, ks, temps, seeds)
            self._ids, self._ks, self._key = ids, ks, key
        elif ks != self._ks:  # only some k (an engine adapts them step by step)
            if min(ks) < 0 or max(ks) > 0xFFFF:
                i = next(i for i, k in enumerate(ks) if not 0 <= k <= 0xFFFF)
                raise ProtocolError(f"seq {self._ids[i]}: k={ks[i]} is outside [0, 65535]")
            self._records["k"] = ks
            self._ks = ks
        # the mirror moves on before the answer: any failure resets it (a new connection)
        data = self._mirror.frame(self._ids, requests, self._records)
        if self._release_queue:
            data = encode_release(self._release_queue) + data
            self._release_queue.clear()
        send_all(self._sock, data, deadline)
        sent = time.monotonic()
        self._mirror.commit()  # while the sidecar works
        if self.spin_s > 0 and t0 >= self._no_spin_until:
            now = time.monotonic()
            window = spin_window(self.spin_s, self.last_server_s)
            if not spin_until_readable(self._sock, min(deadline, now + window)):
                self._no_spin_until = time.monotonic() + SPIN_BACKOFF_S  # no answer in time
        frame = self._reader.read(deadline)
        self.last_wait_s = time.monotonic() - sent
        p, compute_s, dropped = self._mirror.answer(frame, self._ks, self.vocab_size)
        if dropped:
            self._warn_vocab()
        self.last_round_trip_s = time.monotonic() - t0
        self.last_server_s = compute_s
        return p

    def _warn_vocab(self) -> None:
        if not self._warned_vocab:
            self._warned_vocab = True
            log.warning(
                "draft sidecar at %s proposes token ids >= the target's vocabulary "
                "(%d): those sequences get no drafts (serve-draft --vocab-limit)",
                self.path, self.vocab_size,
            )  # fmt: skip

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forgets the sequences; the sidecar hears it with the next step's frame."""
        gone = self._mirror.forget(seq_ids)
        if self._sock is not None:
            self._release_queue.extend(gone)

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock, self._reader = None, None
        self.available = False
