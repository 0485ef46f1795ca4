"""The one-shot all-reduce of tensor-parallel GPU ranks (``kernels/one_shot_all_reduce.py``):
its symmetric buffer, whether it runs, and which sums it takes.

At batch 1 a decode step of an 8B model at TP=2 makes 65 all-reduces of 8 KiB; NCCL's
take ~6.3 us each on 2 x H200 (NOTES e9), 0.42 ms a step, and each is followed by a
residual add + RMSNorm kernel. In the one-shot kernel every rank writes its rows
straight into the others' memory with a flag after them, waits for theirs in its own,
and does the add and norm in the same launch. On 2 x H200 (``bench/all_reduce.py``, lease
r20, NOTES e31), one-shot + norm against NCCL + norm, per launch: 4.7 against 8.4 us at
1 row, 11.6 against 29.6 at 256 rows, 61 against 89 at 2,048 (the earlier pull version:
6.2, 12.5 and 63 us; r18's, which moved rows 2 bytes at a time, lost from 32 rows on). So it
takes sums of up to ``MAX_ROWS`` rows (every decode step and most mixed ones; fewer past
``MAX_BUFFER_BYTES``) of the model's hidden size in the model's dtype; larger ones stay
on NCCL.

The buffer comes from PyTorch's symmetric memory (``torch.distributed._symmetric_memory``:
peer-mapped allocations exchanged through the process group's store); multicast stays
off (``NCCL_ENV``). ``setup_one_shot`` is collective: every rank gets the all-reduce or
every rank gets None (the reason logged), decided by votes over NCCL after each phase
(peer access, allocation, rendezvous, a self-test against known sums), so the ranks
never disagree about which path a sum takes.

Only the first tensor-parallel engine of a process sets it up. On 2 x H200 (lease r18)
the third TP=2 engine of one process, the second to set up the one-shot path, hung (no
step for 8 minutes; not diagnosed further). PyTorch's symmetric memory keeps state per
process-group name, and a later engine's group has the same name; until that is ruled
out, a later engine's ranks all take NCCL (logged). ``kvscale serve`` runs one engine per
process; ``LLM`` objects made one after another in one process are the case this covers.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

from kvscale.kernels.one_shot_all_reduce import (
    buffer_bytes,
    data_bytes_per_row,
    one_shot_all_reduce,
    signal_offset,
)

log = logging.getLogger(__name__)

MAX_ROWS = 2048  # rows (tokens) one sum may have (measured up to here)
MAX_BUFFER_BYTES = 64 << 20  # a rank's data slots: fewer rows for wide models or many ranks
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class OneShotAllReduce:
    """A rank's view of the symmetric buffer: every rank's data and signal addresses
    (``[W]`` int64 on the device) and its own per-row launch counters."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        hidden: int,
        dtype: torch.dtype,
        max_rows: int,
        buffer: torch.Tensor,
        handle: Any,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.hidden = hidden
        self.dtype = dtype
        self.max_rows = max_rows
        self.device = buffer.device
        self._buffer = buffer  # keeps the mapping alive
        self._handle = handle
        ptrs = [int(p) for p in handle.buffer_ptrs]
        self.data_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        offset = signal_offset(max_rows, hidden, dtype, world_size)
        self.signal_ptrs = self.data_ptrs + offset
        self.uses = torch.zeros(max_rows, dtype=torch.int32, device=self.device)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a sum this all-reduce takes: ``[T <= max_rows, hidden]`` in its
        dtype on its device, last dim contiguous."""
        return (
            x.dim() == 2
            and x.shape[1] == self.hidden
            and x.shape[0] <= self.max_rows
            and x.dtype == self.dtype
            and x.device == self.device
            and x.stride(1) == 1
        )

    def all_reduce(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> None:
        """In place (see ``one_shot_all_reduce``)."""
        one_shot_all_reduce(
            x,
            self.data_ptrs,
            self.signal_ptrs,
            self.uses,
            self.rank,
            self.max_rows,
            residual,
            weight,
            eps,
        )

    def self_test(self) -> str | None:
        """Sums known values (one row, a few, all ``max_rows``; each twice, so that both
        slots are used) and compares them with the exact answer; None if all are equal,
        else what differed. Values are small multiples of 1/8: exact in every dtype."""
        for rows in (1, 3, self.max_rows):
            for _ in range(2):
                base = torch.arange(rows * self.hidden, device=self.device)
                v = ((base % 17) - 8).to(torch.float32).view(rows, self.hidden) / 8
                x = (v * (self.rank + 1)).to(self.dtype)
                self.all_reduce(x)
                want = (v * (self.world_size * (self.world_size + 1) // 2)).to(self.dtype)
                if not torch.equal(x, want):
                    bad = int((x != want).sum().item())
                    return f"{bad} of {x.numel()} values wrong in a sum of {rows} rows"
        return None


_set_up_in_this_process = False  # see the module docstring


def rows_within_budget(hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """The most rows whose data slots (two per row, a copy from every rank) fit in
    ``MAX_BUFFER_BYTES``: 2,048 at H = 4096 in bf16 on 2 ranks, 256 at H = 8192 on 8."""
    return MAX_BUFFER_BYTES // data_bytes_per_row(hidden, dtype, world_size)


def _agree(ok: bool, group: Any, device: torch.device) -> bool:
    """True only if every rank passes ``ok``."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _peer_access(device: torch.device, world_size: int) -> str | None:
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(world_size):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"GPU {me} cannot access GPU {other}'s memory (no peer access)"
    return None


def setup_one_shot(
    group: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    hidden: int,
    dtype: torch.dtype,
    max_rows: int = MAX_ROWS,
) -> OneShotAllReduce | None:
    """Collective over ``group`` (None: the default group): every rank gets a working
    ``OneShotAllReduce`` for sums of up to ``max_rows`` rows (fewer if the buffer would
    pass ``MAX_BUFFER_BYTES``), or every rank gets None (why is logged)."""
    global _set_up_in_this_process
    group = group if group is not None else dist.group.WORLD
    reason: str | None = None
    max_rows = min(max_rows, rows_within_budget(hidden, dtype, world_size))
    if device.type != "cuda":
        reason = f"device {device} is not a GPU"
    elif dtype not in DTYPES:
        reason = f"dtype {dtype} (it takes {', '.join(str(d) for d in DTYPES)})"
    elif max_rows < 1:
        reason = f"not one row of {hidden} x {world_size} ranks fits {MAX_BUFFER_BYTES} bytes"
    elif _set_up_in_this_process:
        reason = "an earlier tensor-parallel engine of this process set it up (one per process)"
    else:
        reason = _peer_access(device, world_size)
    if not _agree(reason is None, group, device):
        log.info("all-reduce on NCCL only: %s", reason or "another rank cannot run one-shot")
        return None
    _set_up_in_this_process = True
    comm: OneShotAllReduce | None = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        nbytes = buffer_bytes(max_rows, hidden, dtype, world_size)
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        buffer.zero_()
        torch.cuda.synchronize(device)  # zero before any peer can signal into it
        with warnings.catch_warnings(), contextlib.suppress(AttributeError):
            warnings.simplefilter("ignore")  # deprecated (and not needed) in newer torch
            symm_mem.enable_symm_mem_for_group(group.group_name)
        handle = symm_mem.rendezvous(buffer, group)
        comm = OneShotAllReduce(rank, world_size, hidden, dtype, max_rows, buffer, handle)
    except Exception as e:  # any failure: NCCL for every rank
        reason = f"symmetric memory failed: {type(e).__name__}: {e}"
    if not _agree(comm is not None, group, device):
        log.warning("all-reduce on NCCL only: %s", reason or "another rank failed")
        return None
    assert comm is not None
    try:
        reason = comm.self_test()
    except Exception as e:
        reason = f"self-test raised {type(e).__name__}: {e}"
    if not _agree(reason is None, group, device):
        log.warning("all-reduce on NCCL only: one-shot self-test: %s", reason or "another rank")
        return None
    log.info(
        "one-shot all-reduce over peer memory for sums of up to %d rows (self-test passed)",
        max_rows,
    )
    return comm
