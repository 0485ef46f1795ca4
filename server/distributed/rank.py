"""The process of tensor-parallel rank r >= 1: ``python -m kvscale.server.distributed.rank
--steps-fd N --status-fd M`` (started by rank 0's ``DriverWorker``, never by hand).

It reads its ``Init`` from the steps pipe, joins the process group, builds its
rank-local ``Worker`` (its shard of the model, its KV heads) and then runs every
``StepInput`` rank 0 sends, in order, until ``None`` or the pipe closes. It samples
nothing: rank 0 samples and broadcasts the tokens, which the worker keeps for the
next step's placeholders. Any error is reported as ``Failed`` on the status pipe and
the process exits 1. It dies with rank 0 (``PR_SET_PDEATHSIG``) and ignores SIGINT and
SIGTERM (rank 0 stops it).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

log = logging.getLogger("kvscale.rank")


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent:  # rank 0 died before the prctl
        os._exit(1)


def serve_steps(steps: Connection, status: Connection, init: object) -> None:
    """Builds the rank's worker and runs the steps until told to stop."""
    import torch

    from kvscale.server.distributed.group import cpu_threads_per_rank, join_group, rank_config
    from kvscale.server.distributed.protocol import Init, Joining, Loaded
    from kvscale.server.worker.worker import Worker

    assert isinstance(init, Init)
    config = rank_config(init.config, init.rank)
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(config.engine.tensor_parallel_size))
    status.send(Joining(init.rank, os.getpid()))
    parallel = join_group(init.config, init.rank, port=init.store_port)
    worker = Worker(config, parallel)
    status.send(Loaded(init.rank, worker.num_kv_blocks))
    log.info("rank %d ready: %d KV blocks", init.rank, worker.num_kv_blocks)
    while True:
        try:
            step = steps.recv()
        except EOFError:  # rank 0 is gone
            return
        if step is None:
            return
        worker.launch(step)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="a tensor-parallel rank (started by rank 0)")
    ap.add_argument("--steps-fd", type=int, required=True)
    ap.add_argument("--status-fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    _die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps = Connection(args.steps_fd, writable=False)
    status = Connection(args.status_fd, readable=False)
    rank = -1
    code = 0
    try:
        init = steps.recv()
        rank = init.rank
        logging.basicConfig(
            level=init.log_level.upper(),
            format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
            stream=sys.stderr,
        )
        serve_steps(steps, status, init)
    except BaseException as e:  # report the reason to rank 0, then exit non-zero
        from kvscale.server.distributed.protocol import Failed

        log.exception("tensor-parallel rank %d failed", rank)
        try:
            status.send(Failed(rank, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        code = 1
    sys.stderr.flush()
    # No interpreter teardown: an NCCL communicator can hang in its destructor after
    # CUDA-graph capture, and rank 0 does not need this process's goodbye.
    os._exit(code)


if __name__ == "__main__":
    main()
