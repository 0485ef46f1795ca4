"""Tensor parallelism across processes: one worker process per rank, driven by rank 0.

- ``group``: the process group (NCCL on CUDA, gloo on the CPU), the environment every
  rank runs with, and the start-up checks (visible GPUs).
- ``protocol``: the messages between the driver and the other ranks (plain, pickled).
- ``rank``: the entry point of ranks 1..N-1 (``python -m kvscale.server.distributed.rank``):
  a rank-local ``Worker`` that runs every ``StepInput`` rank 0 broadcasts.
- ``driver``: rank 0's side: starts the other ranks, broadcasts each step before running
  it itself, watches the ranks (a rank that dies or hangs fails the engine with the
  reason) and stops them. ``make_worker`` picks the plain ``Worker`` for one rank.
"""

from kvscale.server.distributed.driver import DriverWorker, TensorParallelError, make_worker

__all__ = ["DriverWorker", "TensorParallelError", "make_worker"]
