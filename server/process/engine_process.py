"""The engine core in a process of its own, driven over two pipes by the API server.

The API process (HTTP, tokenization, detokenization, SSE) and the engine process
(scheduler, model runner, sampler) each have their own interpreter, so HTTP streaming
and detokenization never hold the lock the engine loop needs, and the two run on two
cores. Commands arrive on a ``multiprocessing`` pipe; reports leave as frames
(``frames``) on another, which the API process reads on its event loop. The messages
are the typed classes of ``messages``: ``Ready`` or ``LoadFailed`` once, after loading;
then ``StepDone`` after every step, ``Idle`` about once a second when idle,
``StepFailed`` when a step raised (those requests are dropped) and ``Refused`` for an
``AddRequest`` the engine could not queue.

The process ignores SIGINT and SIGTERM (the API process drains, then stops it) and dies
with its parent (``PR_SET_PDEATHSIG`` on Linux; a closed pipe elsewhere). With tensor
parallelism it is rank 0 and starts the other ranks; when one of them dies or hangs it
sends ``Fatal`` with the reason and exits with ``FATAL_EXIT_CODE``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from kvscale.server.config import ResolvedConfig
from kvscale.server.engine.engine_core import EngineCore
from kvscale.server.process.frames import write_message
from kvscale.server.process.messages import (
    AbortRequest,
    AddRequest,
    Command,
    Fatal,
    FinishSequence,
    Idle,
    LoadFailed,
    Ready,
    Refused,
    Report,
    ResetPrefixCache,
    Shutdown,
    StepDone,
    StepFailed,
)

log = logging.getLogger("kvscale.engine")

IDLE_WAIT_S = 1.0  # an idle engine reports its stats (its heartbeat) this often (seconds)
FATAL_EXIT_CODE = 3  # the engine failed for good (a tensor-parallel rank died or hangs)
_send_lock = threading.Lock()  # whole frames on the report pipe: the loop and a monitor write


class CoreLoop:
    """Runs an EngineCore for the commands arriving on ``conn`` until told to stop or a
    pipe closes, writing its outputs to the file descriptor ``out_fd``. Exceptions of a
    step fail the requests in flight; the loop goes on."""

    def __init__(self, core: EngineCore, conn: Connection, out_fd: int) -> None:
        self.core = core
        self.conn = conn
        self.out_fd = out_fd
        self.num_step_errors = 0
        self._added = 0
        self._stop = False

    def run(self) -> None:
        core, conn = self.core, self.conn
        last_report = time.monotonic()
        try:
            while not self._stop:
                if not core.has_work() and not conn.poll(IDLE_WAIT_S):
                    self._send(Idle(core.stats(), time.monotonic(), self._take_added()))
                    last_report = time.monotonic()
                    continue
                while conn.poll(0):
                    self._handle(conn.recv())
                    if self._stop:
                        return
                if core.has_work():
                    self._step()
                    last_report = time.monotonic()
                elif time.monotonic() - last_report > IDLE_WAIT_S:
                    self._send(Idle(core.stats(), time.monotonic(), self._take_added()))
                    last_report = time.monotonic()
        except (EOFError, OSError):  # the API process is gone
            log.info("engine pipe closed; stopping")

    def _take_added(self) -> int:
        n, self._added = self._added, 0
        return n

    def _send(self, msg: Report) -> None:
        with _send_lock:
            write_message(self.out_fd, msg)

    def _handle(self, msg: Command) -> None:
        match msg:
            case AddRequest(rid, prompt_ids, params, arrival, salt):
                try:
                    self.core.add_request(rid, prompt_ids, params, arrival, salt)
                    self._added += params.n
                except Exception as e:  # the API process validated it: this is rare
                    log.exception("cannot queue request %s", rid)
                    self._send(Refused(rid, f"{type(e).__name__}: {e}"))
            case AbortRequest(rid):
                self.core.abort_request(rid)
            case FinishSequence(rid, index):
                self.core.finish_sequence(rid, index)
            case ResetPrefixCache():
                log.info("prefix cache reset: %d blocks forgotten", self.core.reset_prefix_cache())
            case Shutdown():
                self._stop = True
            case _:
                log.error("unknown engine command %r", msg)

    def _step(self) -> None:
        core = self.core
        try:
            updates = core.step()
        except Exception as e:
            self.num_step_errors += 1
            log.exception("engine step failed; failing the requests in flight")
            rids = core.abort_all()
            self._send(StepFailed(rids, f"engine step failed: {e}"))
            return
        for rid, reason in core.take_refused():
            self._send(Refused(rid, reason))
        self._send(StepDone(updates, core.stats(), time.monotonic(), self._take_added()))


def _die_with_parent() -> None:
    """Asks Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def run_engine_process(
    config: ResolvedConfig,
    conn: Connection,
    out: Connection,
    log_level: str = "INFO",
) -> None:
    """The engine process's entry point: builds the engine core (worker and model) from
    ``config``, reports on ``out`` (the write end of a one-way pipe, used as a file
    descriptor), then serves the commands of ``conn``."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    out_fd = out.fileno()

    def fatal(reason: str) -> None:
        """A tensor-parallel rank failed (called from the monitor thread or the loop):
        report it if the pipe can take it, then exit at once; the other ranks are gone."""
        log.error("engine failed: %s", reason)
        if _send_lock.acquire(timeout=5.0):
            try:
                write_message(out_fd, Fatal(reason))
            except OSError:
                pass
        sys.stderr.flush()
        os._exit(FATAL_EXIT_CODE)

    try:
        core = EngineCore(config, on_failure=fatal)
    except BaseException as e:
        try:
            write_message(out_fd, LoadFailed(f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    info = {
        "architecture": config.model.architecture,
        "device": str(core.device),
        "dtype": str(core.dtype).removeprefix("torch."),
        "num_kv_blocks": core.block_manager.num_blocks,
        "block_size": config.engine.block_size,
    }
    if config.engine.tensor_parallel_size > 1:
        info["tensor_parallel_size"] = config.engine.tensor_parallel_size
    try:
        with _send_lock:
            write_message(out_fd, Ready(info, core.stats()))
    except OSError:
        _stop(core)
        return
    try:
        CoreLoop(core, conn, out_fd).run()
    finally:
        _stop(core)


def _stop(core: EngineCore) -> None:
    stop = getattr(core, "shutdown", None)  # stops the other tensor-parallel ranks
    if stop is not None:
        stop()
