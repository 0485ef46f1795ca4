"""The draft sidecar: the wire format (round trips, malformed frames), the client's
mirror (over random steps) and failure handling against in-thread servers, the
round-trip overhead beyond a stand-in model in a sidecar process, and real ``kvscale
serve-draft`` processes (same drafts as in process, round-trip time, SIGKILL and
restart, another tokenizer refused)."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvscale.server.spec_decode import draft_protocol as wire
from kvscale.server.spec_decode import draft_sidecar
from kvscale.server.spec_decode.draft_protocol import (
    Hello,
    ProtocolError,
    SeqUpdate,
    decode_frame,
    split_frame,
)
from kvscale.server.spec_decode.draft_runner import DraftRunner, draft_engine_config
from kvscale.server.spec_decode.draft_sidecar import (
    SPIN_MAX_S,
    FrameReader,
    SidecarProposer,
    TokenizerMismatch,
    serve_draft,
    socket_path,
    spin_until_readable,
    spin_window,
)
from kvscale.server.spec_decode.prefix import common_prefix_len
from kvscale.server.spec_decode.proposer import DraftRequest, Proposal
from kvscale.server.spec_decode.tokenizer_check import tokenizer_fingerprint
from tests.draft_helpers import rows, swap_two_tokens


def body(frame: bytes) -> bytes:
    got = split_frame(frame)
    assert got is not None and got[1] == b""
    return got[0]


# ---- the wire format ----------------------------------------------------------------------
@pytest.fixture(params=["native", "python"])
def decode(request: pytest.FixtureRequest) -> Callable[[bytes], wire.Frame]:
    """The sidecar's decoder: PROPOSE frames through ``sidecar_native.c``, or all in Python."""
    if request.param == "python":
        return decode_frame
    native = draft_sidecar.native_module()
    assert native is not None, "the C path did not build (no gcc?)"
    return lambda b: draft_sidecar.decode(b, native)


def test_round_trips(decode: Callable[[bytes], wire.Frame]) -> None:
    h = Hello(wire.PROTOCOL_VERSION, "ab" * 32, 32000, 4, 8)
    assert decode(body(wire.encode_hello(h))) == h
    ups = [
        SeqUpdate(7, 0, [1, 2, 3], 4),
        SeqUpdate(-2, 5, np.array([], dtype=np.int64), 1, 0.7, 3),
        SeqUpdate(1 << 40, 100, [31999], 2, 1.5, -1),  # a negative seed travels mod 2**64
        SeqUpdate(9, 3, [0] * 1000, 0, 0.0, (1 << 70) + 5),
    ]
    got = decode(body(wire.encode_propose(ups)))
    assert isinstance(got, wire.ProposeFrame) and len(got) == 4
    for u, d in zip(ups, got.updates(), strict=True):
        assert (d.seq_id, d.keep, d.k) == (u.seq_id, u.keep, u.k)
        assert list(d.new_tokens) == list(u.new_tokens)
        assert d.temperature == pytest.approx(u.temperature)
        assert d.seed == (None if u.seed is None else u.seed % (1 << 64))
    empty = decode(body(wire.encode_propose([])))
    assert isinstance(empty, wire.ProposeFrame) and len(empty) == 0

    p = Proposal(np.array([[5, 6, -1], [-1, -1, -1]]), np.array([2, 0]))
    got = decode(body(wire.encode_proposal(p, 0.0123)))
    assert isinstance(got, wire.ProposalFrame) and got.compute_s == pytest.approx(0.0123)
    assert got.proposal.tokens.tolist() == p.tokens.tolist()
    assert got.proposal.tokens.dtype == np.int64 and got.proposal.num_tokens.tolist() == [2, 0]
    assert got.proposal.q_ids is None and got.proposal.q_probs is None
    rng = np.random.default_rng(0)
    p.q_ids = rng.integers(0, 32000, (2, 3, 4)).astype(np.int32)
    p.q_probs = rng.random((2, 3, 4)).astype(np.float32)
    got = decode(body(wire.encode_proposal(p)))
    assert isinstance(got, wire.ProposalFrame) and got.proposal.q_ids is not None
    assert np.array_equal(got.proposal.q_ids, p.q_ids)
    assert got.proposal.q_probs is not None and np.array_equal(got.proposal.q_probs, p.q_probs)
    assert decode(body(wire.encode_proposal(Proposal.empty(0, 0)))) is not None

    rel = decode(body(wire.encode_release([3, 1 << 50, -1])))
    assert isinstance(rel, wire.ReleaseFrame) and rel.seq_ids.tolist() == [3, 1 << 50, -1]
    err = decode(body(wire.encode_error("no room ✓")))
    assert err == wire.ErrorFrame("no room ✓")
    two = wire.encode_release([1]) + wire.encode_hello(h)
    first = split_frame(two)
    assert first is not None and isinstance(decode(first[0]), wire.ReleaseFrame)
    assert decode(body(first[1])) == h


def _frames() -> list[bytes]:
    p = Proposal(np.array([[5, 6]]), np.array([2]))
    p.q_ids = np.zeros((1, 2, 3), np.int32)
    p.q_probs = np.ones((1, 2, 3), np.float32) / 3
    return [
        wire.encode_hello(Hello(1, "f" * 64, 32000, 4, 8)),
        wire.encode_propose([SeqUpdate(1, 2, [3, 4, 5], 4, 0.5, 9), SeqUpdate(2, 0, [7], 1)]),
        wire.encode_proposal(p, 0.5),
        wire.encode_release([1, 2, 3]),
    ]


def test_truncated_and_padded_frames_raise(decode: Callable[[bytes], wire.Frame]) -> None:
    for frame in _frames():
        b = body(frame)
        for cut in range(len(b)):
            with pytest.raises(ProtocolError):
                decode(b[:cut])
        with pytest.raises(ProtocolError):
            decode(b + b"\0")
        for cut in range(len(frame)):
            assert split_frame(frame[:cut]) is None  # incomplete: wait for more


def test_malformed_frames_raise_clear_errors(decode: Callable[[bytes], wire.Frame]) -> None:
    with pytest.raises(ProtocolError, match="unknown frame kind 99"):
        decode(b"\x63abc")
    with pytest.raises(ProtocolError, match="out of range"):
        wire.frame_length(b"\0\0\0\0")
    with pytest.raises(ProtocolError, match="out of range"):
        split_frame(b"\xff\xff\xff\xff" + b"\0" * 8)  # a garbage length is refused at once
    with pytest.raises(ProtocolError, match="not ASCII"):
        decode(body(wire.encode_hello(Hello(1, "x", 1, 1, 1)))[:-1] + b"\xff")
    good = bytearray(body(wire.encode_propose([SeqUpdate(1, 0, [3, 4], 2)])))
    bad = bytearray(good)
    bad[1 + 4 : 1 + 8] = (3).to_bytes(4, "little")  # T = 3 tokens declared, 2 in the records
    bad += b"\0\0\0\0"
    with pytest.raises(ProtocolError, match="add up"):
        decode(bytes(bad))
    bad = bytearray(good)
    bad[9 + 8 : 9 + 12] = (-1 & 0xFFFFFFFF).to_bytes(4, "little")  # keep = -1
    with pytest.raises(ProtocolError, match="negative"):
        decode(bytes(bad))
    prop = bytearray(body(wire.encode_proposal(Proposal(np.array([[5, 6]]), np.array([2])))))
    prop[-4:] = (3).to_bytes(4, "little")  # num_tokens 3 > K = 2
    with pytest.raises(ProtocolError, match="num_tokens"):
        decode(bytes(prop))
    with pytest.raises(ProtocolError, match="token ids"):
        wire.encode_propose([SeqUpdate(1, 0, [-4], 1)])
    with pytest.raises(ProtocolError, match="temperature"):
        wire.encode_propose([SeqUpdate(1, 0, [4], 1, float("nan"))])


def test_reading_never_hangs() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.encode_release([1, 2])[:7])  # a partial frame, then silence
        reader = FrameReader(b)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.read(time.monotonic() + 0.2)
        assert time.monotonic() - t0 < 1.0
        a.close()
        with pytest.raises(ConnectionError, match="closed"):
            reader.read(time.monotonic() + 1.0)


def test_addresses() -> None:
    assert socket_path("unix:///tmp/d.sock") == "/tmp/d.sock"
    assert socket_path("unix:/tmp/d.sock") == "/tmp/d.sock"
    assert socket_path("/tmp/d.sock") == "/tmp/d.sock"
    with pytest.raises(ValueError, match="unix"):
        socket_path("tcp://localhost:9")


# ---- the client against in-thread servers -------------------------------------------------
class EchoModel:
    """A stand-in draft model: drafts ``last + 1, last + 2, ...`` and records what it got."""

    max_k, top_m, vocab_size = 4, 8, 32000

    def __init__(self, delay_s: float = 0.0) -> None:
        self.seen: list[list[list[int]]] = []
        self.released: list[int] = []
        self.resets = 0
        self.delay_s = delay_s

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        time.sleep(self.delay_s)
        self.seen.append([list(r.token_ids) for r in requests])
        kmax = max((r.k for r in requests), default=0)
        p = Proposal.empty(len(requests), kmax)
        for i, r in enumerate(requests):
            k = min(r.k, self.max_k)
            p.tokens[i, :k] = [(r.token_ids[-1] + j + 1) % 32000 for j in range(k)]
            p.num_tokens[i] = k
        return p

    def release(self, seq_ids: Iterable[int]) -> None:
        self.released.extend(seq_ids)

    def reset(self) -> None:
        self.resets += 1


@pytest.fixture
def thread_server(tmp_path: Path) -> Iterator[Callable[..., tuple[str, EchoModel]]]:
    stops: list[tuple[threading.Event, threading.Thread]] = []

    def start(model: EchoModel | None = None, fingerprint: str = "fp") -> tuple[str, EchoModel]:
        model = model or EchoModel()
        path = str(tmp_path / f"s{len(stops)}.sock")
        stop, ready = threading.Event(), threading.Event()
        t = threading.Thread(
            target=serve_draft, args=(model, path, fingerprint, stop, ready.set), daemon=True
        )
        t.start()
        assert ready.wait(5)
        stops.append((stop, t))
        return path, model

    yield start
    for stop, t in stops:
        stop.set()
        t.join(5)


@pytest.fixture(params=["native", "python"])
def client_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The client's compiled per-step path (``sidecar_native.c``) or its Python one."""
    monkeypatch.setenv("KVSCALE_NATIVE", "1" if request.param == "native" else "0")
    built = draft_sidecar.native_module() is not None
    assert built == (request.param == "native"), "the C path did not build (no gcc?)"
    return request.param


def test_client_sends_only_new_tokens_and_mirrors_the_server(
    thread_server: Callable[..., tuple[str, EchoModel]],
    monkeypatch: pytest.MonkeyPatch,
    client_path: str,
) -> None:
    sent: list[list[SeqUpdate]] = []  # each PROPOSE as the server decoded it
    propose = draft_sidecar._Session.propose

    def record(session: draft_sidecar._Session, frame: wire.ProposeFrame) -> bytes:
        sent.append(frame.updates())
        return propose(session, frame)

    monkeypatch.setattr(draft_sidecar._Session, "propose", record)
    path, model = thread_server()
    client = SidecarProposer(f"unix://{path}", "fp", timeout_s=5)
    assert client.available and client.hello is not None and client.hello.max_k == 4
    seqs = {1: [1, 10, 11], 2: [1, 20]}
    for step in range(5):
        reqs = [DraftRequest(s, t, 3, 0.5 if s == 2 else 0.0, s) for s, t in seqs.items()]
        p = client.propose(reqs)
        assert model.seen[-1] == [r.token_ids for r in reqs]  # rebuilt exactly server-side
        if step:  # the server holds the last tokens + 3 drafts: seq 1 kept one of them
            one, two = sent[-1]
            assert (one.keep, list(one.new_tokens)) == (len(seqs[1]) - 1, [99 + step])
            assert (two.keep, list(two.new_tokens)) == (len(seqs[2]) - 1, [5000 + 7 * (step - 1)])
        assert rows(p) == [[(t[-1] + j) % 32000 for j in (1, 2, 3)] for t in seqs.values()]
        # keep one draft of seq 1, none of seq 2, then a new token each
        seqs[1] = seqs[1] + rows(p)[0][:1] + [100 + step]
        seqs[2] = seqs[2] + [5000 + 7 * step]  # never one of its drafts (last + 1..3)
    client.release([2])
    seqs.pop(2)
    seqs[3] = [1, 2, 3]
    client.propose([DraftRequest(s, t, 2) for s, t in seqs.items()])
    assert model.released == [2] and model.seen[-1] == list(seqs.values())
    assert client.num_failures == 0 and client.num_reconnects == 0
    # a second client replaces the first: the server starts over
    resets = model.resets
    other = SidecarProposer(path, "fp", timeout_s=5)
    assert model.resets == resets + 1
    other.propose([DraftRequest(1, [1, 5], 1)])
    assert model.seen[-1] == [[1, 5]]
    assert client.propose([DraftRequest(1, seqs[1], 1)]).num_tokens.tolist() == [0]
    assert not client.available and client.num_failures == 1
    other.close()
    client.close()


def test_the_mirror_sends_the_longest_valid_prefix_over_a_changing_batch(
    thread_server: Callable[..., tuple[str, EchoModel]],
    monkeypatch: pytest.MonkeyPatch,
    client_path: str,
) -> None:
    """Random steps: batches of changing composition and order, per-step k, some drafts
    accepted, released and reused ids, and sequences replaced or shrunk without a release
    (a broken contract: detected by the last sent token, then sent whole). Each step the
    sidecar rebuilds exactly the caller's tokens, and ``keep`` is the longest prefix of
    what it holds that is still valid (0 for a replaced sequence)."""
    checked: list[int] = []
    replaced: set[int] = set()
    propose = draft_sidecar._Session.propose

    def record(session: draft_sidecar._Session, frame: wire.ProposeFrame) -> bytes:
        for u in frame.updates():
            req = session.requests.get(u.seq_id)
            held = [] if req is None else list(req.token_ids)
            now = held[: u.keep] + list(u.new_tokens)
            lcp = common_prefix_len(held, now)
            assert u.keep == (0 if u.seq_id in replaced else lcp), (u.seq_id, u.keep, lcp)
            checked.append(u.keep)
        return propose(session, frame)

    monkeypatch.setattr(draft_sidecar._Session, "propose", record)

    class Params(EchoModel):  # records each request's parameters too
        def __init__(self) -> None:
            super().__init__()
            self.params: list[list[tuple[int, float, int | None]]] = []

        def propose(self, requests: list[DraftRequest]) -> Proposal:
            self.params.append([(r.k, r.temperature, r.seed) for r in requests])
            return super().propose(requests)

    model = Params()
    path, _ = thread_server(model)
    client = SidecarProposer(path, "fp", timeout_s=5)
    rng = np.random.default_rng(7)
    sampling: dict[int, tuple[float, int | None]] = {}
    ids: list[int] = []
    seqs: dict[int, list[int]] = {}
    drafts: dict[int, list[int]] = {}
    next_id = 0
    for step in range(120):
        replaced.clear()
        while len(seqs) < 12:  # new sequences
            seqs[next_id] = [1, *rng.integers(3, 30000, int(rng.integers(1, 30))).tolist()]
            next_id += 1
        if step % 10 < 5 or not ids:  # some sit a step out; else the same batch again
            ids = [s for s in seqs if rng.random() < 0.8]
            if step % 7 == 0:
                rng.shuffle(ids)
        for sid in ids:
            toks = seqs[sid]
            if step and rng.random() < 0.03:  # replaced without a release
                seqs[sid] = [1, *rng.integers(3, 30000, int(rng.integers(1, 30))).tolist()]
                replaced.add(sid)
            elif step and rng.random() < 0.03 and len(toks) > 2:  # shrunk
                del toks[int(rng.integers(1, len(toks) - 1)) :]
                replaced.add(sid)
            else:  # some of its drafts accepted, then a token of the "target"
                d = drafts.pop(sid, [])
                toks += d[: int(rng.integers(0, len(d) + 1))]
                toks.append(int(rng.integers(3, 30000)))
            drafts.pop(sid, None)
        for sid in ids:  # the sampling parameters change now and then
            if sid not in sampling or rng.random() < 0.1:
                seed = int(rng.integers(0, 1 << 40)) if rng.random() < 0.5 else None
                sampling[sid] = (float(rng.choice([0.0, 0.7, 1.3])), seed)
        reqs = [DraftRequest(s, seqs[s], int(rng.integers(1, 5)), *sampling[s]) for s in ids]
        p = client.propose(reqs)
        assert client.available and client.num_failures == 0, step
        assert model.seen[-1] == [seqs[s] for s in ids], step  # rebuilt exactly
        want = [(r.k, float(np.float32(r.temperature)), r.seed) for r in reqs]
        assert model.params[-1] == want, step
        assert rows(p) == [[(seqs[s][-1] + j) % 32000 for j in range(1, r.k + 1)]
                           for s, r in zip(ids, reqs, strict=True)]  # fmt: skip
        drafts.update(zip(ids, rows(p), strict=True))
        if step % 5 == 4:  # some finish; their ids are reused at once
            gone = [s for s in seqs if rng.random() < 0.2]
            client.release(gone)
            for sid in gone:
                seqs[sid] = [1, *rng.integers(3, 30000, 5).tolist()]
                drafts.pop(sid, None)
    assert len(checked) > 1000 and sum(checked) > 0 and model.released
    client.close()


def _answer(rng: np.random.Generator, reqs: list[DraftRequest], top_m: int) -> Proposal:
    """A random PROPOSAL for ``reqs``: up to each k drafts (ids now and then past 32000),
    a q of ``top_m`` ids (0: none) that sums to 1 over its row."""
    ks = [r.k for r in reqs]
    b, kmax = len(reqs), max(ks, default=0)
    p = Proposal.empty(b, kmax)
    for i, k in enumerate(ks):
        n = int(rng.integers(0, k + 1)) if rng.random() < 0.3 else k
        p.num_tokens[i] = n
        p.tokens[i, :n] = rng.integers(0, 32000 + (rng.random() < 0.05) * 9, n)
    if top_m:
        p.q_ids = rng.integers(0, 32000, (b, kmax, top_m)).astype(np.int32)
        p.q_ids[rng.random((b, kmax)) < 0.02, 0] = 32003  # past the vocabulary, in q
        p.q_probs = rng.dirichlet(np.ones(top_m), (b, kmax)).astype(np.float32)
    return p


def test_the_compiled_client_equals_the_python_one() -> None:
    """``sidecar_native.c`` against the Python path it replaces, on the same random steps
    (batches of changing composition and order, per-step k, accepted drafts, replaced and
    shrunk sequences, released ids, answers with and without q, drafts and q ids past the
    target's vocabulary): the same PROPOSE bytes, the same drafts and q, the same mirror
    after each step; malformed answers and bad tokens are refused by both."""
    assert draft_sidecar.native_module() is not None, "the C path did not build (no gcc?)"
    py, nat = draft_sidecar._Mirror(native=False), draft_sidecar._Mirror(native=True)
    rng = np.random.default_rng(11)
    seqs: dict[int, list[int]] = {}
    drafts: dict[int, list[int]] = {}
    ids: list[int] = []
    next_id = 0
    for step in range(400):
        while len(seqs) < 10:
            seqs[next_id] = [1, *rng.integers(3, 30000, int(rng.integers(0, 20))).tolist()]
            next_id += 1
        if step % 6 < 3 or not ids:
            ids = [s for s in seqs if rng.random() < 0.8]
            rng.shuffle(ids)
        for sid in ids:
            toks, u = seqs[sid], rng.random()
            if step and u < 0.03:  # replaced without a release
                seqs[sid] = rng.integers(3, 30000, int(rng.integers(0, 9))).tolist()
            elif step and u < 0.06:
                del toks[int(rng.integers(0, len(toks) + 1)) :]  # shrunk (maybe emptied)
            else:
                d = drafts.get(sid, [])
                toks += d[: int(rng.integers(0, len(d) + 1))]
                toks.append(int(rng.integers(3, 30000)))
            drafts.pop(sid, None)
        reqs = [DraftRequest(s, seqs[s], int(rng.integers(1, 7))) for s in ids]
        ks = [r.k for r in reqs]
        zero = np.zeros(len(ids), np.int64)
        rec = wire.propose_records(ids, zero, zero, ks, [0.0] * len(ids), [None] * len(ids))
        want = py.frame(ids, reqs, rec.copy())
        py.commit()
        assert nat.frame(ids, reqs, rec.copy()) == want, step
        p = _answer(rng, reqs, int(rng.choice([0, 0, 4])))
        frame = body(wire.encode_proposal(p, compute_s=1e-3 * step))
        r, want_s, want_dropped = py.answer(frame, ks, 32000)
        q, compute_s, dropped = nat.answer(frame, ks, 32000)
        np.testing.assert_array_equal(q.tokens, r.tokens)
        np.testing.assert_array_equal(q.num_tokens, r.num_tokens)
        assert (q.q_ids is None) == (r.q_ids is None) and compute_s == want_s
        if q.q_ids is not None:
            np.testing.assert_array_equal(q.q_ids, r.q_ids)
            np.testing.assert_array_equal(q.q_probs, r.q_probs)
        assert dropped == want_dropped == bool((r.num_tokens < p.num_tokens).any())
        np.testing.assert_array_equal(nat.rows_base, py.rows_base)
        np.testing.assert_array_equal(nat.rows_expect, py.rows_expect)
        drafts.update((s, r.tokens[i, : r.num_tokens[i]].tolist()) for i, s in enumerate(ids))
        if step % 9 == 8:
            gone = [s for s in seqs if rng.random() < 0.3]
            assert py.forget(gone) == nat.forget(gone)
            for sid in gone:
                seqs.pop(sid)
            ids = [s for s in ids if s in seqs]
    # the sidecar's decoding of random PROPOSE frames: every column the same
    native = draft_sidecar.native_module()
    for _ in range(50):
        ups = [
            SeqUpdate(int(rng.integers(-(2**62), 2**62)), int(rng.integers(0, 99)),
                      rng.integers(0, 2**31, int(rng.integers(0, 9))), int(rng.integers(0, 9)),
                      float(rng.choice([0.0, 0.7, 1e30])),
                      None if rng.random() < 0.5 else int(rng.integers(0, 2**63)))
            for _ in range(int(rng.integers(0, 12)))
        ]  # fmt: skip
        frame = body(wire.encode_propose(ups))
        a, b = decode_frame(frame), draft_sidecar.decode(frame, native)
        assert isinstance(a, wire.ProposeFrame) and isinstance(b, wire.ProposeFrame)
        for col in ("seq_ids", "keep", "k", "temperature", "has_seed", "offsets", "token_list"):
            assert getattr(a, col) == getattr(b, col), col
        assert a.records.tobytes() == b.records.tobytes() and a.updates() == b.updates()
        np.testing.assert_array_equal(a.tokens, b.tokens)
    # refused by both: a token outside int32, an answer of another shape, a negative
    # draft, more drafts than asked for, a negative id in q, a truncated body
    for m in (py, nat):
        m.reset()
        with pytest.raises(ProtocolError, match="out of range"):
            m.frame([1], [DraftRequest(1, [5, 2**31], 2)], rec[:1].copy())
    reqs = [DraftRequest(1, [5, 6], 2), DraftRequest(2, [7], 3)]
    for m in (py, nat):
        m.frame(
            [1, 2], reqs, wire.propose_records([1, 2], [0, 0], [0, 0], [2, 3], [0, 0], [None] * 2)
        )
    good = _answer(np.random.default_rng(1), reqs, 4)
    bad = [
        (Proposal(good.tokens[:, :2], np.array([2, 2])), "shape"),
        (replace(good, tokens=np.where(np.arange(3) == 0, -5, good.tokens)), "negative draft"),
        (replace(good, num_tokens=np.array([3, 3])), "more drafts than asked"),
        (replace(good, q_ids=good.q_ids - 40000), "negative id in q"),
    ]
    good.num_tokens[:] = [2, 3]
    for m in (py, nat):
        for p, match in bad:
            with pytest.raises(ProtocolError, match=match):
                m.answer(body(wire.encode_proposal(p)), [2, 3], 32000)
        with pytest.raises(ProtocolError, match="expected"):
            m.answer(body(wire.encode_proposal(good))[:-4], [2, 3], 32000)
        with pytest.raises(draft_sidecar.SidecarError, match="refused the step: no"):
            m.answer(body(wire.encode_error("no")), [2, 3], 32000)


def test_frames_larger_than_the_socket_buffers_travel_whole(
    thread_server: Callable[..., tuple[str, EchoModel]], client_path: str
) -> None:
    """A prefill of several MB: the non-blocking writes and reads go on in pieces."""
    path, model = thread_server()
    client = SidecarProposer(path, "fp", timeout_s=30)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 32000, 150_000).tolist() for _ in range(8)]
    p = client.propose([DraftRequest(i, t, 3) for i, t in enumerate(seqs)])
    assert client.available and model.seen[-1] == seqs
    assert rows(p) == [[(t[-1] + j) % 32000 for j in (1, 2, 3)] for t in seqs]
    for i, t in enumerate(seqs):
        t += [*rows(p)[i][: i % 4], 7]
    client.propose([DraftRequest(i, t, 3) for i, t in enumerate(seqs)])
    assert client.available and model.seen[-1] == seqs
    client.close()


def test_a_silent_sidecar_costs_one_timeout_then_retries_later(
    thread_server: Callable[..., tuple[str, EchoModel]],
) -> None:
    path, model = thread_server(EchoModel(delay_s=0.5))
    client = SidecarProposer(path, "fp", timeout_s=0.1, retry_s=0.3)
    req = [DraftRequest(1, [1, 2, 3], 2), DraftRequest(2, [1, 4], 3)]
    t0 = time.monotonic()
    p = client.propose(req)
    took = time.monotonic() - t0
    assert took < 0.1 + 0.05, took  # bounded by the timeout, not the server
    assert p.tokens.shape == (2, 3) and p.num_tokens.tolist() == [0, 0]
    assert not client.available and client.num_failures == 1
    t0 = time.monotonic()
    client.propose(req)  # within retry_s: no attempt at all
    assert time.monotonic() - t0 < 0.01 and client.num_failures == 1
    time.sleep(0.3)
    model.delay_s = 0.0
    time.sleep(0.5)  # let the server finish the abandoned step
    p = client.propose(req)
    assert client.available and client.num_reconnects == 1 and rows(p) == [[4, 5], [5, 6, 7]]


def test_an_error_frame_or_garbage_is_a_failure_not_an_exception(
    thread_server: Callable[..., tuple[str, EchoModel]], tmp_path: Path, client_path: str
) -> None:
    class Broken(EchoModel):
        def propose(self, requests: list[DraftRequest]) -> Proposal:
            raise RuntimeError("out of memory")

    path, _ = thread_server(Broken())
    client = SidecarProposer(path, "fp", timeout_s=2, retry_s=0.0)
    assert client.propose([DraftRequest(1, [1, 2], 2)]).num_tokens.tolist() == [0]
    assert client.num_failures == 1 and not client.available

    class BadTokens(EchoModel):
        def propose(self, requests: list[DraftRequest]) -> Proposal:
            p = super().propose(requests)
            p.tokens[:, 0] = 40000  # past the target's vocabulary
            return p

    path, _ = thread_server(BadTokens())
    client = SidecarProposer(path, "fp", timeout_s=2, vocab_size=32000)
    got = client.propose([DraftRequest(1, [1, 2], 2), DraftRequest(2, [1, 7], 2)])
    assert got.num_tokens.tolist() == [0, 0] and (got.tokens == -1).all()  # past the vocab
    assert client.num_failures == 0 and client.available  # a row matter, not a failure
    client.vocab_size = 40001
    assert rows(client.propose([DraftRequest(1, [1, 2, 9], 2)])) == [[40000, 11]]

    class Negative(EchoModel):
        def propose(self, requests: list[DraftRequest]) -> Proposal:
            p = super().propose(requests)
            p.tokens[:, 0] = -7
            return p

    path, _ = thread_server(Negative())
    client = SidecarProposer(path, "fp", timeout_s=2)
    assert client.propose([DraftRequest(1, [1, 2], 2)]).num_tokens.tolist() == [0]
    assert client.num_failures == 1 and not client.available

    # a peer that is not a sidecar at all
    raw = str(tmp_path / "raw.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(raw)
    srv.listen(1)

    def garbage() -> None:
        conn, _ = srv.accept()
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        time.sleep(0.5)
        conn.close()

    t = threading.Thread(target=garbage, daemon=True)
    t.start()
    client = SidecarProposer(raw, "fp", timeout_s=1)
    assert not client.available and client.num_failures == 1
    t.join(2)
    srv.close()
    # and nobody listening at all
    client = SidecarProposer(str(tmp_path / "nobody.sock"), "fp", timeout_s=1)
    assert not client.available and client.propose([]).tokens.shape == (0, 0)


def test_another_tokenizer_is_refused_at_start(
    thread_server: Callable[..., tuple[str, EchoModel]],
) -> None:
    path, _ = thread_server(fingerprint="0123456789abcdef" * 4)
    with pytest.raises(ValueError, match="another tokenizer") as e:
        SidecarProposer(path, "fedcba9876543210" * 4)
    assert isinstance(e.value, TokenizerMismatch) and path in str(e.value)
    assert "0123456789ab" in str(e.value) and "fedcba987654" in str(e.value)


# ---- real sidecar processes -----------------------------------------------------------------
class Sidecar:
    """``kvscale serve-draft`` in a subprocess, its log in a file."""

    def __init__(self, model: Path, sock: str, log: Path) -> None:
        self.log = log
        # one thread: tiny per-sequence ops with several OpenMP threads crawl on a busy CI
        # machine; the test process runs its own runner with one thread too (same maths)
        env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable, "-m", "kvscale.cli", "serve-draft", "--model", str(model),
            "--socket", f"unix://{sock}", "--device", "cpu", "--max-num-seqs", "64",
            "--max-model-len", "512", "--num-speculative-tokens", "4",
        ]  # fmt: skip
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stderr=f, stdout=f, env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if "draft sidecar ready" in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"the sidecar did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sock_dir() -> Iterator[Path]:
    """A short folder for sockets: AF_UNIX paths are limited to ~107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="kvd-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _batch(n: int, k: int, seed0: int) -> list[DraftRequest]:
    rng = np.random.default_rng(seed0)
    out = []
    for i in range(n):
        prompt = [1, *rng.integers(3, 32000, int(rng.integers(8, 24))).tolist()]
        temp, seed = (0.0, None) if i % 3 == 0 else (0.8, 1000 + i)
        out.append(DraftRequest(i, prompt, k, temp, seed))
    return out


def _advance(reqs: list[DraftRequest], p: Proposal, step: int) -> list[DraftRequest]:
    """Each sequence keeps some of its drafts, then a token of the "target"."""
    out = []
    for i, r in enumerate(reqs):
        kept = int(p.num_tokens[i]) * ((i + step) % 3) // 2
        toks = [*r.token_ids, *p.tokens[i, :kept].tolist(), 3 + (i * 7 + step) % 31000]
        out.append(DraftRequest(r.seq_id, toks, r.k, r.temperature, r.seed))
    return out


# a sidecar process serving a stand-in draft model (numpy: the next token ids, a uniform
# 8-wide q), busy for the given time a step
PROFILE_SIDECAR = Path(__file__).resolve().parents[1] / "bench" / "profile_sidecar.py"


def test_sidecar_round_trip_overhead_beyond_a_stand_in_model(sock_dir: Path) -> None:
    """The issue's measure: a step's round trip on loopback beyond the sidecar's time in
    the draft model, batch 64, k = 4, steady state (each sequence takes 1 to 5 tokens a
    step: some drafts accepted, then the target's). The budget is 0.3 ms (the median of
    the steps), asserted on the best median of three rounds of 100 steps (a shared CI
    machine: another job's burst can spoil a round), with the compiled path on both sides
    (``sidecar_native.c``: 0.04-0.05 ms on the 2-core development machine; the Python
    path 0.1-0.13, on an H100 host 0.19-0.46 against the compiled 0.11-0.22)."""
    assert draft_sidecar.native_module() is not None, "the C path did not build (no gcc?)"
    sock = str(sock_dir / "stand-in.sock")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(PROFILE_SIDECAR), "--serve", sock, "--model-ms", "0"],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        client = SidecarProposer(sock, "stand-in", timeout_s=10)
        rng = np.random.default_rng(0)
        reqs = [
            DraftRequest(i, [1, *rng.integers(3, 32000, 16).tolist()], 4, 0.8 * (i % 3 > 0))
            for i in range(64)
        ]
        overheads, computes = [], []
        for step in range(310):
            p = client.propose(reqs)
            assert client.available and p.num_tokens.tolist() == [4] * 64, step
            if step >= 10:
                overheads.append(client.last_round_trip_s - client.last_server_s)
                computes.append(client.last_server_s)
            for i, (r, row) in enumerate(zip(reqs, p.tokens.tolist(), strict=True)):
                r.token_ids += row[: (i + step) % 5]  # type: ignore[operator]
                r.token_ids.append(3 + (i * 7 + step) % 31000)  # type: ignore[attr-defined]
        rounds = [statistics.median(overheads[i : i + 100]) for i in range(0, 300, 100)]
        overhead = statistics.median(overheads)
        print(
            f"\nsidecar round trip, batch 64, k=4, stand-in model: {overhead * 1e3:.3f} ms "
            f"beyond the model's {statistics.median(computes) * 1e3:.3f} ms (median of "
            f"{len(overheads)} steps; p10 {np.percentile(overheads, 10) * 1e3:.3f}, p90 "
            f"{np.percentile(overheads, 90) * 1e3:.3f} ms; rounds of 100: "
            f"{', '.join(f'{r * 1e3:.3f}' for r in rounds)} ms; target 0.3 ms)"
        )
        assert min(rounds) < 0.3e-3
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_profile_script_splits_the_round_trip() -> None:
    """bench/profile_sidecar.py (run on the GPU hosts, whose CPUs differ): one line a
    model time, the stand-in's busy time seen as the model's, and the client's profile."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run(
        [sys.executable, str(PROFILE_SIDECAR), "--model-ms", "0,2", "--steps", "40", "--profile"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    ).stdout  # fmt: skip
    nums = r"(\d+\.\d+)"
    pattern = (
        rf"model (\S+) ms: round trip {nums} ms, model {nums}, beyond the model {nums} "
        rf"\(budget 0.3\): the client's own work {nums}, the rest (-?\d+\.\d+) \(medians of 30"
    )
    found = re.findall(pattern, out)
    assert [m[0] for m in found] == ["0", "2"], out
    for ms, total, model, beyond, own, _ in (tuple(map(float, m)) for m in found):
        # The client's own work may overlap the sidecar's compute, so it can exceed what is
        # beyond the model (the script prints a negative rest then): a clean-clone CI run
        # had medians of 0.133 and 0.117 ms. Each part is positive and the model fits in
        # the round trip.
        assert model >= ms and total > model and beyond > 0 and own > 0
    # the client's profile (which functions top it depends on the load: a busy machine
    # turns the client's polling off)
    assert "Ordered by: internal time" in out and "draft_sidecar.py" in out


def test_the_breakdown_script_times_both_sides() -> None:
    """bench/sidecar_breakdown.py: the host's primitives, then per model time each side's
    functions (the wait for the answer and the sidecar's model time among them)."""
    script = PROFILE_SIDECAR.parent / "sidecar_breakdown.py"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run(
        [sys.executable, str(script), "--model-ms", "0,2", "--steps", "80"],
        capture_output=True, text=True, env=env, timeout=180, check=True,
    ).stdout  # fmt: skip
    assert "os.sched_yield()" in out and "numpy: x + x (64 int64)" in out
    head = r"model (0|2) ms, (native|python) path, medians a step \(us\), the client:"
    runs = re.findall(head, out)
    assert runs == [("0", "native"), ("2", "native"), ("0", "python"), ("2", "python")], out
    for (busy_ms, path), side in zip(runs, re.split(head, out)[3::3], strict=True):
        client, sidecar = side.split("  the sidecar:")
        rows = {
            m[0].strip(): float(m[1])
            for part in (client, sidecar)
            for m in re.findall(r"^  (.+?)\s+(\d+\.\d+)$", part, re.M)
        }
        answer = "PROPOSAL answer (decode, check, mirror)" if path == "native" else "check"
        parts = ["PROPOSE frame (mirror + encode)", answer, "decode PROPOSE"]
        if path == "python":
            parts += ["mirror.step", "encode PROPOSE", "decode PROPOSAL", "mirror.drafted"]
        for name in parts:
            assert 0 < rows[name] < 5e3, (name, rows)
        assert (answer == "check") == ("decode PROPOSAL" in rows)  # the path it says
        assert rows["model"] >= int(busy_ms) * 1e3  # the stand-in's busy time, in us
        # (the poll for the answer is absent where a busy machine turned polling off)
        frame = rows["PROPOSE frame (mirror + encode)"]
        assert rows["propose (the round trip)"] > frame + rows[answer]


def test_the_client_polls_through_the_drafts_compute_time(
    thread_server: Callable[..., tuple[str, EchoModel]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft that takes 3 ms a step (a GPU draft takes milliseconds): after the first
    step, whose time the client does not know yet, the client's polling window covers
    the sidecar's compute time of the last step, so it polls until the answer comes
    instead of sleeping after its 1 ms window (a wake-up costs up to ~1 ms)."""
    assert spin_window(0.001, 0.004) == pytest.approx(0.006)
    assert spin_window(0.001, SPIN_MAX_S) == 0.001  # a CPU draft's cores stay free
    known: list[float] = []  # the sidecar's compute time each window was given
    polls: list[bool | None] = []
    real_window, real_spin = draft_sidecar.spin_window, draft_sidecar.spin_until_readable

    def window(spin_s: float, last_compute_s: float) -> float:
        known.append(last_compute_s)
        return real_window(spin_s, last_compute_s)

    def recorded(sock: socket.socket, until: float) -> bool | None:
        polls.append(real_spin(sock, until))
        return polls[-1]

    monkeypatch.setattr(draft_sidecar, "spin_window", window)
    monkeypatch.setattr(draft_sidecar, "spin_until_readable", recorded)
    path, _ = thread_server(EchoModel(delay_s=0.003))
    client = SidecarProposer(path, "fp", timeout_s=5)
    reqs = [DraftRequest(i, [1, 2, 3 + i], 4) for i in range(8)]
    for _ in range(40):
        assert client.propose(reqs).num_tokens.tolist() == [4] * 8
        for r in reqs:
            r.token_ids.append(7)  # type: ignore[attr-defined]
    client.close()
    # the first window knows no compute time (1 ms alone); each later one is given the 3+
    # ms the sidecar took (a window that lapses pauses polling for SPIN_BACKOFF_S: fewer
    # windows than steps). Whether a poll then gets the answer depends on the machine's
    # load (another process may hold the CPU the sidecar needs): the poll itself is
    # tested below, the gain on a quiet machine by bench/sidecar_breakdown.py.
    assert len(known) >= 5 and known[0] == 0.0 and min(known[1:]) >= 0.003, known
    assert len(polls) == len(known)


def test_polling_ends_with_the_data_or_the_window() -> None:
    """True once the socket has data, False when the window passes without any; None
    (the loop lost the CPU for a while) may come instead, so a call is repeated until it
    kept the CPU."""
    a, b = socket.socketpair()
    try:

        def poll(window_s: float, send_after_s: float | None = None) -> bool:
            for _ in range(50):
                sender = None
                if send_after_s is not None:
                    sender = threading.Timer(send_after_s, a.send, (b"x",))
                    sender.start()
                got = spin_until_readable(b, time.monotonic() + window_s)
                if sender is not None:
                    sender.join()
                while select.select([b], [], [], 0)[0]:
                    b.recv(16)  # empty again for the next call
                if got is not None:
                    return got
            pytest.fail("50 polls in a row lost the CPU")

        a.send(b"x")
        assert spin_until_readable(b, time.monotonic() + 0.001) is True  # data already there
        b.recv(16)
        assert poll(0.002) is False  # nothing came within the window
        assert poll(2.0, send_after_s=0.003) is True  # the data came within it
    finally:
        a.close()
        b.close()


def test_sidecar_process_drafts_as_in_process_and_survives_a_kill(
    llama_ckpt: Path, sock_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    sock = str(sock_dir / "draft.sock")
    other_ckpt = swap_two_tokens(llama_ckpt, tmp_path / "other-tokenizer")
    other_sock = str(sock_dir / "other.sock")
    side = Sidecar(llama_ckpt, sock, tmp_path / "sidecar.log")
    other = Sidecar(other_ckpt, other_sock, tmp_path / "other.log")  # starts alongside
    try:
        fp = tokenizer_fingerprint(llama_ckpt)
        local = DraftRunner.from_engine_config(
            draft_engine_config(str(llama_ckpt), device="cpu", max_num_seqs=64, max_model_len=512),
            k=4,
        )
        side.wait_ready()
        client = SidecarProposer(sock, fp, timeout_s=60, retry_s=0.5, vocab_size=32000)
        assert client.available and client.hello is not None and client.hello.fingerprint == fp

        # the same drafts (greedy and seeded sampled, over rollbacks) as in process
        reqs = _batch(16, 4, 0)
        for step in range(4):
            got, want = client.propose(reqs), local.propose(reqs)
            assert rows(got) == rows(want), step
            assert want.q_ids is not None and got.q_ids is not None and got.q_probs is not None
            assert np.array_equal(got.q_ids, want.q_ids)
            assert np.allclose(got.q_probs, want.q_probs, atol=1e-6)
            reqs = _advance(reqs, got, step)
        client.release([0, 1])
        local.release([0, 1])
        reqs = reqs[2:]
        assert rows(client.propose(reqs)) == rows(local.propose(reqs))

        # the round trip of batch 64, k = 4, beyond the sidecar's time in the model
        big = [replace(r, seq_id=1000 + r.seq_id) for r in _batch(64, 4, 1)]
        overheads, computes = [], []
        for step in range(4):
            p = client.propose(big)
            assert p.num_tokens.tolist() == [4] * 64
            if step:  # steady state: a catch-up of a few tokens per sequence
                overheads.append(client.last_round_trip_s - client.last_server_s)
                computes.append(client.last_server_s)
            big = _advance(big, p, step)
        overhead = statistics.median(overheads)
        print(
            f"\nsidecar round trip, batch 64, k=4: {overhead * 1e3:.2f} ms beyond the draft "
            f"model's {statistics.median(computes) * 1e3:.1f} ms (median of "
            f"{len(overheads)} steps; min {min(overheads) * 1e3:.2f} ms)"
        )
        assert overhead < 0.05

        # SIGKILL while a step is in flight: no drafts, no exception, unavailable
        fresh = [replace(r, seq_id=2000 + r.seq_id) for r in _batch(64, 4, 2)]
        killer = threading.Timer(0.05, side.proc.send_signal, (signal.SIGKILL,))
        killer.start()
        p = client.propose(fresh)
        killer.join()
        side.proc.wait(30)
        if client.available:  # the step beat the kill: the next one meets a dead socket
            p = client.propose(fresh)
        assert p.num_tokens.tolist() == [0] * 64 and not client.available
        assert client.num_failures >= 1
        t0 = time.monotonic()
        assert client.propose(fresh).num_tokens.sum() == 0  # fast while it is down
        assert time.monotonic() - t0 < 0.1

        # restarted on the same socket: back within retry_s (a one-token probe), mirror reset
        side = Sidecar(llama_ckpt, sock, tmp_path / "sidecar2.log")
        side.wait_ready()
        ready = time.monotonic()
        probe = [DraftRequest(3000, [1, 5], 1)]
        while not client.available and time.monotonic() - ready < 5.0:
            client.propose(probe)
            time.sleep(0.02)
        assert client.available and client.num_reconnects == 1
        assert time.monotonic() - ready < client.retry_s + 0.5
        local.reset()
        assert rows(client.propose(reqs)) == rows(local.propose(reqs))

        # a sidecar serving another tokenizer is refused at start with the reason
        other.wait_ready()
        with pytest.raises(ValueError, match="another tokenizer") as e:
            SidecarProposer(f"unix://{other_sock}", fp, timeout_s=60)
        assert other_sock in str(e.value) and fp[:12] in str(e.value)

        # SIGTERM: a clean exit that removes the socket
        client.close()
        side.proc.send_signal(signal.SIGTERM)
        assert side.proc.wait(30) == 0
        assert not Path(sock).exists() and "draft sidecar stopped" in side.log.read_text()
    finally:
        side.stop()
        other.stop()


def test_serve_draft_cli_refuses_a_bad_model(sock_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "-m", "kvscale.cli", "serve-draft", "--socket"]
    bad = subprocess.run(
        [*base, str(sock_dir / "x.sock"), "--model", str(tmp_path / "missing")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and "cannot load the draft model" in bad.stderr
    assert "is not a directory" in bad.stderr and not (sock_dir / "x.sock").exists()


def test_engine_serves_through_a_sidecar_kill_and_restart(
    llama_ckpt: Path, sock_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    """The engine with draft = target in a sidecar: greedy tokens equal greedy without
    speculation; the sidecar killed mid-run loses no request (the engine goes on without
    drafts and says so in its stats); restarted, speculation resumes."""
    from kvscale.server import LLM, SamplingParams

    sock = str(sock_dir / "engine.sock")
    side = Sidecar(llama_ckpt, sock, tmp_path / "sidecar.log")
    side.wait_ready()
    prompts = [[1, *range(100 + 7 * i, 140 + 9 * i)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # chunked prefill (16-token budget) and preemption (a small pool) on every run
    tight = dict(device="cpu", num_kv_blocks=16, block_size=8, max_num_batched_tokens=16,
                 max_num_seqs=6, max_model_len=96)  # fmt: skip
    want = [o.outputs[0].token_ids for o in LLM(str(llama_ckpt), **tight).generate(prompts, sp)]
    llm = LLM(
        str(llama_ckpt), **tight, speculative_method="draft",
        speculative_model=f"unix://{sock}", num_speculative_tokens=3,
    )  # fmt: skip
    proposer = llm.engine.core.speculator.proposer  # type: ignore[union-attr]
    proposer.timeout_s = 60.0  # a busy 2-core CI machine: the tiny draft may take seconds
    eng = llm.engine

    def run(kill_after: int | None = None) -> list[list[int]]:
        rids = []
        for i, p in enumerate(prompts):
            rid = f"{id(p)}-{i}-{kill_after}"
            eng.queue(rid, p, eng.prepare(p, sp), sp)
            rids.append(rid)
        done = {}
        for step in range(1000):
            if kill_after is not None and step == kill_after:
                side.stop()
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            if len(done) == len(rids):
                break
        return [done[r] for r in rids]

    try:
        assert run() == want
        s = eng.stats()
        assert s.num_preemptions > 0
        assert s.spec_draft_available is True and s.spec_num_drafts > 0
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens  # draft = target
        assert run(kill_after=3) == want  # killed mid-run: nothing lost, same tokens
        s2 = eng.stats()
        assert s2.spec_draft_available is False and s2.spec_draft_failures > 0
        side = Sidecar(llama_ckpt, sock, tmp_path / "sidecar2.log")
        side.wait_ready()
        time.sleep(proposer.retry_s)  # the client reconnects at most this often
        assert run() == want
        s3 = eng.stats()
        assert s3.spec_draft_available is True and s3.spec_num_drafts > s2.spec_num_drafts
    finally:
        side.stop()
