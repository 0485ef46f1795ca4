"""Runs a test's ranks as spawned processes and collects what each reports.

``target(rank, *args, q)`` runs in each of ``world`` processes (``spawn``: nothing of the
test process is inherited but its environment and ``sys.path``) and puts
``(rank, result)`` on ``q`` once, by value (a tensor shared through a file descriptor
would not outlive a rank that exits first). A rank that dies or ranks that do not all
report within ``timeout_s`` fail the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).parents[1])  # spawned ranks import the test module from here


def run_ranks(
    target: Callable[..., None], world: int, args: tuple[Any, ...], timeout_s: float
) -> dict[int, Any]:
    """Each rank's result by rank (module docstring)."""
    added = ROOT not in sys.path
    if added:
        sys.path.insert(0, ROOT)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q)) for r in range(world)]
    try:
        for p in procs:
            p.start()
    finally:
        if added:
            sys.path.remove(ROOT)
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, result = q.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank process died: exit codes {dead}"
                assert time.monotonic() < deadline, f"ranks {set(range(world)) - set(got)} hang"
                continue
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got
