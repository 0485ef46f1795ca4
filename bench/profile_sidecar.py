"""Where the draft sidecar's round trip goes beyond the draft model, on this host.

A stand-in sidecar (``serve_draft`` serving a numpy "model" that drafts the next token ids
with an 8-wide q, busy for ``--model-ms`` a step, as a GPU draft keeps its process busy)
answers the real client, driven as ``tests/gpu/test_draft_cuda.py`` drives it: batch 64,
k = 4, sampled (temperature 0.8, seeded), 200-token prompts, 2 drafts and 1 token
accepted a step. Per configuration, medians over the steps after a warm-up (ms): the
round trip, the model's time, what is beyond it, and of that the client's own work
(encoding, the mirror, decoding and checking the answer) and the rest (socket, wake-ups,
the sidecar's own work). ``--cuda`` initialises CUDA in the client's process first (as in
the engine); ``--profile`` prints the client's functions by own time.

    python bench/profile_sidecar.py [--model-ms 0,7.8] [--steps 200] [--cuda] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvscale.server.spec_decode import draft_sidecar
from kvscale.server.spec_decode.draft_sidecar import SidecarProposer, serve_draft
from kvscale.server.spec_decode.proposer import DraftRequest, Proposal

BATCH, K, TOP_M, VOCAB = 64, 4, 8, 32000
FINGERPRINT = "stand-in"


class StandIn:
    """Drafts ``last + 1 .. last + k`` with a uniform q over 8 ids; spins ``busy_s``."""

    max_k, top_m, vocab_size = K, TOP_M, VOCAB

    def __init__(self, busy_s: float) -> None:
        self.busy_s = busy_s

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        until = time.perf_counter() + self.busy_s
        while time.perf_counter() < until:
            pass
        b, k = len(requests), max(r.k for r in requests)
        last = np.fromiter((r.token_ids[-1] for r in requests), np.int64, b)
        p = Proposal((last[:, None] + np.arange(1, k + 1)) % VOCAB, np.full(b, k))
        p.q_ids = ((p.tokens[:, :, None] + np.arange(TOP_M)) % VOCAB).astype(np.int32)
        p.q_probs = np.full((b, k, TOP_M), 1 / TOP_M, np.float32)
        return p

    def release(self, seq_ids: object) -> None:
        pass

    def reset(self) -> None:
        pass


def first_requests() -> list[DraftRequest]:
    """The workload's first step: ``BATCH`` sampled sequences of 200-token prompts."""
    rng = np.random.default_rng(0)
    return [
        DraftRequest(i, [1, *rng.integers(3, VOCAB, 200).tolist()], K, 0.8, i) for i in range(BATCH)
    ]


def next_requests(reqs: list[DraftRequest], p: Proposal) -> list[DraftRequest]:
    """The next step: each sequence keeps 2 of its drafts, then the target's token."""
    return [
        DraftRequest(r.seq_id, [*r.token_ids, *p.tokens[i, :2].tolist(), 5], K, 0.8, i)
        for i, r in enumerate(reqs)
    ]


def serve(sock: str, busy_s: float) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve_draft(StandIn(busy_s), sock, FINGERPRINT, stop, lambda: print("ready", flush=True))


def measure(model_ms: float, steps: int, profile: bool) -> str:
    sock = str(Path(tempfile.mkdtemp(prefix="kvside-")) / "s.sock")
    cmd = [sys.executable, __file__, "--serve", sock, "--model-ms", str(model_ms)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        client = SidecarProposer(sock, FINGERPRINT, timeout_s=10)
        reqs = first_requests()
        cols: dict[str, list[float]] = {"total": [], "model": [], "own": []}
        prof = cProfile.Profile()
        for step in range(steps):
            if profile and step == 10:
                prof.enable()
            p = client.propose(reqs)
            assert client.available and (p.num_tokens == K).all(), step
            if step >= 10:
                cols["total"].append(client.last_round_trip_s)
                cols["model"].append(client.last_server_s)
                cols["own"].append(client.last_round_trip_s - client.last_wait_s)
            reqs = next_requests(reqs, p)
        prof.disable()
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
    med = {k: statistics.median(v) * 1e3 for k, v in cols.items()}
    beyond = statistics.median(
        (t - m) * 1e3 for t, m in zip(cols["total"], cols["model"], strict=True)
    )
    line = (
        f"model {model_ms:g} ms: round trip {med['total']:.3f} ms, model {med['model']:.3f}, "
        f"beyond the model {beyond:.3f} (budget 0.3): the client's own work "
        f"{med['own']:.3f}, the rest {beyond - med['own']:.3f} (medians of "
        f"{len(cols['total'])} steps)"
    )
    if profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        line += "\n" + out.getvalue()
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-ms", default="0,7.8", help="the stand-in's busy time a step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cuda", action="store_true", help="initialise CUDA in the client first")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # the sidecar process: its socket
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, float(args.model_ms) / 1e3)
        return
    if args.cuda:
        import torch

        torch.zeros(1, device="cuda").sum().item()
    path = "native" if draft_sidecar.native_module() is not None else "python"
    print(
        f"client: python {sys.version.split()[0]}, numpy {np.__version__}, cuda {args.cuda}, "
        f"{path} path (KVSCALE_NATIVE={os.environ.get('KVSCALE_NATIVE', '1')})"
    )
    for ms in (float(x) for x in args.model_ms.split(",")):
        print(measure(ms, args.steps, args.profile), flush=True)


if __name__ == "__main__":
    main()
