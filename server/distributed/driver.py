"""Rank 0 of a tensor-parallel engine: the worker the engine core drives.

``DriverWorker`` looks like a ``Worker`` to the engine core (``launch``,
``decode_graph_size``, ``num_kv_blocks``, ...). It starts ranks 1..N-1 as processes of
their own (``rank``), joins the process group with them and builds rank 0's own
``Worker``. Each step is pickled once and written to every rank's pipe before rank 0
runs it itself, so all ranks enter the step's collectives together; rank 0 samples and
broadcasts the tokens (``Worker``), so the other ranks get each step without the arrays
only the sampler reads. The engine's pipelining is unchanged: step N+1 is
broadcast and launched before step N's tokens are read, and each rank copies its step
to its device in one pinned transfer.

A monitor thread watches the ranks: a rank that exits (with its own error message when
it sent one), or a step that waits on the ranks longer than ``watchdog_timeout``
seconds (a rank that hangs: its process state is named), fails the engine. The other
ranks are killed, ``on_failure(reason)`` is called (the engine process reports and
exits non-zero there) and the engine core's next call raises ``TensorParallelError``.
A step that raises on rank 0 fails the engine too: the ranks may have run collectives
rank 0 did not, so none of them can be trusted with the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from kvscale.server.config import ResolvedConfig
from kvscale.server.distributed.group import (
    apply_env,
    cpu_threads_per_rank,
    group_timeout,
    join_group,
    leave_group,
    open_store,
    rank_config,
    rank_env,
)
from kvscale.server.distributed.protocol import Failed, Init, Joining, Loaded
from kvscale.server.worker.step import SamplingPlan, StepInput
from kvscale.server.worker.worker import PendingStep, StepResult, Worker

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the monitor looks at the ranks
STOP_TIMEOUT_S = 10.0  # how long a rank may take to stop before it is killed
REASON_WAIT_S = 2.0  # how long a failed call on rank 0 waits for the monitor's reason


# Arrays only rank 0's sampler reads: the other ranks never get them (penalty histories
# alone can be megabytes a step).
SAMPLER_ONLY = frozenset(
    {
        "sampling", "ban_rows", "ban_cols", "prompt_ids", "output_ids",
        "bias_rows", "bias_cols", "bias_vals", "grammar_rows",
    }
)  # fmt: skip


def step_for_other_ranks(step: StepInput) -> StepInput:
    """``step`` without what only rank 0's sampler reads; the other ranks still know how
    many rows sample (they receive that many tokens) and whether prompt logprobs are
    computed (their logits are gathered over the ranks: every rank takes part)."""
    n = step.sampling.num_rows
    arrays = {k: v for k, v in step.arrays.items() if k not in SAMPLER_ONLY}
    plan = SamplingPlan([None] * n, [None] * n, prompt_logprobs=step.sampling.prompt_logprobs)
    return dataclasses.replace(step, arrays=arrays, sampling=plan)


class TensorParallelError(RuntimeError):
    """A rank died, hung or failed: the engine cannot go on (the message says which)."""


def make_worker(config: ResolvedConfig, on_failure: Callable[[str], None] | None = None) -> Any:
    """The engine's worker: a plain ``Worker`` for one rank, else a ``DriverWorker``
    (``on_failure(reason)`` is called once if a rank fails)."""
    if config.engine.tensor_parallel_size == 1:
        return Worker(config)
    return DriverWorker(config, on_failure)


_PROC_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible I/O"}


def _process_state(pid: int) -> str | None:
    """What Linux says a process is doing, when notable (stopped, in D state...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return _PROC_STATES.get(state, "zombie" if state == "Z" else None)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Rank:
    """A rank process and rank 0's ends of its two pipes."""

    def __init__(
        self, rank: int, proc: subprocess.Popen[bytes], steps: Connection, status: Connection
    ):
        self.rank = rank
        self.proc = proc
        self.steps = steps
        self.status = status
        self.pid = proc.pid
        self.error: str | None = None  # what the rank said when it failed
        self.joined = False
        self.loaded = False


PIPE_BYTES = 1 << 20  # a step's arrays fit in the pipe: sending never waits on the rank


def _enlarge_pipe(fd: int) -> None:
    """Grows a pipe's buffer (Linux ``F_SETPIPE_SZ``); best effort."""
    if sys.platform.startswith("linux"):
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, 1031, PIPE_BYTES)  # F_SETPIPE_SZ


def _spawn(rank: int, env: dict[str, str]) -> _Rank:
    steps_r, steps_w = os.pipe()
    _enlarge_pipe(steps_w)
    status_r, status_w = os.pipe()
    cmd = [
        sys.executable, "-m", "kvscale.server.distributed.rank",
        "--steps-fd", str(steps_r), "--status-fd", str(status_w), "--parent", str(os.getpid()),
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, pass_fds=(steps_r, status_w), env=env, close_fds=True)
    finally:
        os.close(steps_r)
        os.close(status_w)
    return _Rank(
        rank, proc, Connection(steps_w, readable=False), Connection(status_r, writable=False)
    )


def _stop_ranks(ranks: list[_Rank], timeout: float) -> None:
    """Asks every rank to stop, waits up to ``timeout`` seconds, kills what is left."""
    for r in ranks:
        with contextlib.suppress(OSError, ValueError):
            r.steps.send(None)
    deadline = time.monotonic() + timeout
    for r in ranks:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
    for r in ranks:
        for conn in (r.steps, r.status):
            with contextlib.suppress(OSError):
                conn.close()


def _release(ranks: list[_Rank], nccl: bool, threads: int) -> None:
    """Stops the ranks and leaves the process group (a ``DriverWorker``'s finalizer)."""
    _stop_ranks(ranks, STOP_TIMEOUT_S)
    with contextlib.suppress(Exception):
        leave_group(nccl)
    torch.set_num_threads(threads)


class _WatchedStep(PendingStep):
    """Rank 0's pending step; reading its result counts as waiting on the ranks."""

    def __init__(self, inner: PendingStep, driver: DriverWorker) -> None:
        self._inner = inner
        self._driver = driver

    @property
    def num_rows(self) -> int:
        return self._inner.num_rows

    def result(self) -> StepResult:
        with self._driver._waiting():
            try:
                result = self._inner.result()
            except BaseException as e:
                raise self._driver._failed_call(e) from e
        self._driver._check()  # an aborted collective completes, with garbage
        return result


class DriverWorker:
    """Rank 0's ``Worker`` plus ranks 1..N-1 in processes of their own."""

    def __init__(
        self, config: ResolvedConfig, on_failure: Callable[[str], None] | None = None
    ) -> None:
        self.config = config
        self.world_size = tp = config.engine.tensor_parallel_size
        self.watchdog_timeout = config.engine.watchdog_timeout
        self._on_failure = on_failure
        self._failure: str | None = None
        self._fail_lock = threading.Lock()
        self._busy_since: float | None = None
        self._closing = False
        self._ranks: list[_Rank] = []
        device = torch.device(rank_config(config, 0).device)
        self._nccl = device.type == "cuda"
        self._threads = torch.get_num_threads()
        apply_env()
        store = open_store(tp, group_timeout(config))
        env = rank_env()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        for r in range(1, tp):
            rank = _spawn(r, env)
            self._ranks.append(rank)
            rank.steps.send(Init(config, r, store.port, str(level)))
            log.info("tensor-parallel rank %d started: pid %d", r, rank.pid)
        self._finalizer = weakref.finalize(
            self, _release, list(self._ranks), self._nccl, self._threads
        )
        self._monitor = threading.Thread(
            target=_monitor, args=(weakref.ref(self),), name="kvscale-tp-monitor", daemon=True
        )
        self._monitor.start()
        try:
            self._wait_for(lambda r: r.joined)
            if not self._nccl:
                torch.set_num_threads(cpu_threads_per_rank(tp))
            self.parallel = join_group(config, 0, store=store)
            self.worker = Worker(rank_config(config, 0), self.parallel)
            self._wait_for(lambda r: r.loaded)
        except BaseException as e:
            if self._failure is None and isinstance(e, RuntimeError):
                self._wait_for_reason()  # gloo raises on rank 0 when a peer dies
            failure = self._failure
            for r in self._ranks:  # they may wait in a collective rank 0 never joins
                with contextlib.suppress(OSError):
                    r.proc.kill()
            self.shutdown()
            if failure is None:
                raise  # rank 0's own error (a bad checkpoint, too little memory...), as is
            raise TensorParallelError(f"tensor-parallel start-up failed: {failure}") from e
        log.info(
            "tensor parallelism: %d ranks on %s, %d KV blocks each",
            tp,
            "NCCL" if self._nccl else "gloo",
            self.worker.num_kv_blocks,
        )

    # ---- what the engine core uses (the rest comes from rank 0's Worker) ---------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "worker":
            raise AttributeError(name)
        return getattr(self.worker, name)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks

    def decode_graph_size(self, num_seqs: int) -> int:
        return self.worker.decode_graph_size(num_seqs)

    def launch(self, step: StepInput) -> PendingStep:
        """Sends ``step`` to every rank, then launches it on rank 0."""
        return self.sample(self.forward(step))

    def forward(self, step: StepInput) -> Any:
        """Sends ``step`` to every rank (which run it whole: rank 0's tokens reach them
        by broadcast), then enqueues rank 0's forward pass; ``sample`` follows."""
        self._check()
        with self._waiting():
            try:
                data = pickle.dumps(step_for_other_ranks(step), protocol=pickle.HIGHEST_PROTOCOL)
                for r in self._ranks:
                    r.steps.send_bytes(data)
                return self.worker.forward(step)
            except BaseException as e:
                raise self._failed_call(e) from e

    def sample(self, fwd: Any, bitmask: Any = None) -> PendingStep:
        """Rank 0's sampling of a forwarded step (its tokens go to the other ranks)."""
        self._check()
        with self._waiting():
            try:
                pending = self.worker.sample(fwd, bitmask)
            except BaseException as e:
                raise self._failed_call(e) from e
        return _WatchedStep(pending, self)

    def shutdown(self) -> None:
        """Stops the other ranks and leaves the process group (idempotent)."""
        if self._closing:
            return
        self._closing = True
        worker = self.__dict__.get("worker")
        if worker is not None and self._failure is None:  # no collective left waiting
            try:
                worker.release_graphs()  # else NCCL's teardown waits for them
            except Exception:  # the shutdown goes on: leave_group gives up after 10 s
                log.exception("dropping rank 0's CUDA graphs before leaving the group failed")
        self._finalizer()

    @property
    def failure(self) -> str | None:
        """Why the engine failed (None while it runs)."""
        return self._failure

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [r.pid for r in self._ranks]

    # ---- failure detection ---------------------------------------------------------
    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def _check(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def _failed_call(self, e: BaseException) -> TensorParallelError:
        """The error for a call on rank 0 that raised: a rank's failure (gloo raises on
        rank 0 when a peer dies; the monitor names it), else rank 0's own error."""
        self._wait_for_reason()
        if self._failure is None:
            self._fail(
                f"rank 0 failed in a step ({type(e).__name__}: {e}); the ranks may have "
                "run collectives rank 0 did not, so the engine stops"
            )
        return TensorParallelError(self._failure or str(e))

    def _wait_for_reason(self) -> None:
        """Gives the monitor ``REASON_WAIT_S`` to name a rank's failure (a peer's socket
        may close before its death is seen)."""
        deadline = time.monotonic() + REASON_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _fail(self, reason: str) -> None:
        with self._fail_lock:
            if self._failure is not None or self._closing:
                return
            self._failure = reason
        log.error("tensor parallelism failed: %s", reason)
        for r in self._ranks:  # unblocks rank 0's collectives (gloo raises on a lost peer)
            with contextlib.suppress(OSError):
                r.proc.kill()
        if self._nccl and self._on_failure is None:
            with contextlib.suppress(Exception):  # NCCL waits forever on a lost peer
                import torch.distributed.distributed_c10d as c10d

                c10d._abort_process_group()
        if self._on_failure is not None:
            self._on_failure(reason)

    def _wait_for(self, done: Callable[[_Rank], bool]) -> None:
        while not all(done(r) for r in self._ranks):
            self._check()
            time.sleep(POLL_S)
        self._check()

    def _read_status(self, timeout: float) -> None:
        conns = {r.status: r for r in self._ranks if not r.status.closed}
        if not conns:
            time.sleep(timeout)
            return
        for conn in wait(list(conns), timeout):
            r = conns[conn]  # type: ignore[index]
            try:
                msg = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                conn.close()  # type: ignore[union-attr]
                continue
            if isinstance(msg, Joining):
                r.joined = True
            elif isinstance(msg, Loaded):
                r.loaded = True
            elif isinstance(msg, Failed):
                r.error = msg.message

    def _watch_once(self) -> None:
        """One look of the monitor thread: rank exits and steps that wait too long."""
        self._read_status(POLL_S)
        if self._closing:
            return
        for r in self._ranks:
            code = r.proc.poll()
            if code is None:
                continue
            self._read_status(0.2)  # its last words, if any are on the way
            said = f": {r.error}" if r.error else ""
            self._fail(f"tensor-parallel rank {r.rank} (pid {r.pid}) {_describe_exit(code)}{said}")
            return
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.watchdog_timeout:
            states = [
                f"rank {r.rank} (pid {r.pid}) is {s}"
                for r in self._ranks
                if (s := _process_state(r.pid))
            ]
            detail = "; ".join(states) if states else "no rank process has exited"
            self._fail(
                f"a step waited on the tensor-parallel ranks for more than "
                f"{self.watchdog_timeout:g}s (watchdog_timeout): a rank hangs ({detail})"
            )
            return


def _monitor(ref: weakref.ReferenceType[DriverWorker]) -> None:
    """The monitor thread; holds its driver only while looking (a driver nobody uses any
    more is collected, and its finalizer stops the ranks)."""
    while True:
        driver = ref()
        if driver is None or driver._closing or driver._failure is not None:
            return
        driver._watch_once()
        del driver
