"""Small host-side helpers shared by the kernel wrappers (no Triton import here)."""

from __future__ import annotations

import functools
import os

import torch

# Stand-in SM count where there is no CUDA device (the Triton CPU interpreter).
CPU_NUM_SMS = 4


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; ``CPU_NUM_SMS`` off CUDA."""
    if device.type != "cuda":
        return CPU_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_num_sms(index)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact ``"ieee"`` for fp32 operands, default otherwise.

    16-bit operands are multiplied exactly and accumulated in fp32 by the tensor cores;
    fp32 operands would otherwise be truncated to tf32.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


MAX_ARRIVAL_COUNTERS = 4096  # program groups that one launch can count arrivals for
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's ``[MAX_ARRIVAL_COUNTERS]`` int32 arrival counters, zero between
    launches: a kernel whose programs combine their partial results counts each group's
    arrivals in one, and the group's last program does the combining and resets it to 0.
    Shared by every such kernel on the device (w4a16's split-K products), which is safe
    while they run one at a time on a stream; made outside any CUDA-graph capture (the
    first call of a shape runs eagerly before capture)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counters: first used inside a CUDA-graph capture")
        counters = _COUNTERS[device] = torch.zeros(
            MAX_ARRIVAL_COUNTERS, dtype=torch.int32, device=device
        )
    return counters
