"""Where the draft sidecar's round trip goes, function by function, on this host.

``bench/profile_sidecar.py``'s stand-in sidecar and workload (batch 64, k = 4, sampled,
2 drafts and a bonus accepted a step), with the client's and the sidecar's protocol
functions each wrapped in a timer (``perf_counter_ns``; a wrapper adds ~0.2 us a call on
a 2-core development machine). Prints each function's median per step (us) on both sides
and the host's cost of the primitives the round trip is made of (a system call, a small
numpy op, a Python loop over 64 items), so hosts can be compared by their parts.

    python bench/sidecar_breakdown.py [--model-ms 0,7.8] [--steps 300] [--paths native,python]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvscale.server.spec_decode import draft_sidecar as ds

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_sidecar as ps  # a sibling script: its stand-in and constants

WARMUP = 50
Times = dict[str, list[int]]


def timed(times: Times, owner: object, name: str, label: str) -> None:
    """Replaces ``owner.name`` by a wrapper adding each call's ns to ``times[label]``."""
    f = getattr(owner, name)
    acc = times.setdefault(label, [])

    def wrapper(*a: object, **kw: object) -> object:
        t = time.perf_counter_ns()
        try:
            return f(*a, **kw)
        finally:
            acc.append(time.perf_counter_ns() - t)

    setattr(owner, name, wrapper)


def medians(times: Times, skip: int) -> dict[str, float]:
    """Median us per call after the first ``skip`` calls of each."""
    return {k: statistics.median(v[skip:]) / 1e3 for k, v in times.items() if len(v) > skip}


def serve(sock: str, model_ms: float, out: str) -> None:
    """The stand-in sidecar with its side's functions timed; medians to ``out`` at exit."""
    times: Times = {}
    timed(times, ds, "decode", "decode PROPOSE")
    timed(times, ds._Session, "propose", "session.propose (model included)")
    timed(times, ds._Session, "settle", "settle (after the send)")
    timed(times, ds, "encode_proposal", "encode PROPOSAL")
    timed(times, ds, "send_all", "send")
    timed(times, ds.FrameReader, "read", "read")
    timed(times, ps.StandIn, "propose", "model")
    timed(times, ds, "_serve_one", "serve one frame")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ready = lambda: print("ready", flush=True)  # noqa: E731
    ds.serve_draft(ps.StandIn(model_ms / 1e3), sock, ps.FINGERPRINT, stop, ready)
    Path(out).write_text(json.dumps(medians(times, WARMUP)))


def client(model_ms: float, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(the client's medians, the sidecar's) for one stand-in model time."""
    times: Times = {}
    # (the Python path's parts run only with KVSCALE_NATIVE=0; a row per function called)
    for owner, name, label in (
        (ds._Mirror, "frame", "PROPOSE frame (mirror + encode)"),
        (ds._Mirror, "step", "  mirror.step"),
        (ds, "encode_propose_records", "  encode PROPOSE"),
        (ds, "send_all", "send"),
        (ds._Mirror, "commit", "mirror.commit (during the wait)"),
        (ds, "spin_until_readable", "poll for the answer (the wait)"),
        (ds.FrameReader, "read", "read"),
        (ds._Mirror, "answer", "PROPOSAL answer (decode, check, mirror)"),
        (ds, "decode_frame", "  decode PROPOSAL"),
        (ds._Mirror, "_check", "  check"),
        (ds._Mirror, "drafted", "  mirror.drafted"),
        (ds, "_drop_rows_past_vocab", "  vocabulary check"),
        (ds.SidecarProposer, "propose", "propose (the round trip)"),
    ):
        timed(times, owner, name, label)
    tmp = Path(tempfile.mkdtemp(prefix="kvside-"))
    sock, out = str(tmp / "s.sock"), str(tmp / "server.json")
    cmd = [sys.executable, __file__, "--serve", sock, "--model-ms", str(model_ms), "--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        c = ds.SidecarProposer(sock, ps.FINGERPRINT, timeout_s=10, vocab_size=ps.VOCAB)
        reqs = ps.first_requests()
        beyond = []
        for _ in range(steps):
            p = c.propose(reqs)
            assert c.available and (p.num_tokens == ps.K).all()
            beyond.append(c.last_round_trip_s - c.last_server_s)
            reqs = ps.next_requests(reqs, p)
        c.close()
    finally:
        proc.terminate()
        proc.wait(30)
    own = medians(times, WARMUP)
    own["beyond the model (round trip - model)"] = statistics.median(beyond[WARMUP:]) * 1e6
    return own, json.loads(Path(out).read_text())


def per_call_us(f: Callable[[], object], n: int = 20000) -> float:
    """Median over 5 runs of the mean us a call of ``f``."""
    runs = []
    for _ in range(5):
        t = time.perf_counter_ns()
        for _ in range(n):
            f()
        runs.append((time.perf_counter_ns() - t) / n / 1e3)
    return statistics.median(runs)


def primitives() -> dict[str, float]:
    """The host's cost (us a call) of what a round trip is made of."""
    a, b = socket.socketpair()
    a.setblocking(False)
    poller = select.poll()
    poller.register(a, select.POLLIN)
    x = np.arange(64, dtype=np.int64)
    lists = [list(range(200)) for _ in range(64)]
    out = {
        "time.monotonic()": per_call_us(time.monotonic),
        "os.sched_yield()": per_call_us(os.sched_yield),
        "poll(0) on a socket": per_call_us(lambda: poller.poll(0)),
        "send 1 KiB + recv it (socketpair)": per_call_us(
            lambda: (b.send(b"x" * 1024), a.recv(4096)), 5000
        ),
        "numpy: x + x (64 int64)": per_call_us(lambda: x + x),
        "numpy: x.tolist() (64)": per_call_us(x.tolist),
        "python: [l[-3:] for l in 64 lists]": per_call_us(lambda: [v[-3:] for v in lists], 5000),
    }
    a.close()
    b.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-ms", default="0,7.8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--paths", default="native,python", help="the client's compiled path, its Python one"
    )
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, float(args.model_ms), args.out)
        return
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    for name, us in primitives().items():
        print(f"  {name:40s} {us:7.2f} us")
    for path, ms in itertools.product(args.paths.split(","), map(float, args.model_ms.split(","))):
        os.environ["KVSCALE_NATIVE"] = "1" if path == "native" else "0"
        if (ds.native_module() is not None) != (path == "native"):
            sys.exit(f"the {path} path is not available (the C build needs gcc)")
        own, side = client(ms, args.steps)
        print(f"model {ms:g} ms, {path} path, medians a step (us), the client:")
        for name, us in own.items():
            print(f"  {name:40s} {us:8.1f}")
        print("  the sidecar:")
        for name, us in side.items():
            print(f"  {name:40s} {us:8.1f}")


if __name__ == "__main__":
    main()
