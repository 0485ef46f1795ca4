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
