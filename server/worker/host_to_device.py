"""One pinned host-to-device transfer for all of a step's small inputs.

A step needs a dozen small arrays on the device (token ids, positions, slots, block
tables, sampling parameters...). Copying each on its own costs one launch and, from
pageable memory, one host stall apiece. ``to_device`` packs them into one pinned byte
buffer, issues a single non-blocking copy, and returns typed device views of the
sections. Each section starts on a 64-byte boundary: Triton specializes kernels on
whether pointer arguments are 16-byte aligned, so sections at varying alignments would
compile new kernel variants mid-run. The pinned buffer is fresh each step: PyTorch's
caching host allocator hands it out again only once the copy that read it has finished.
"""

from __future__ import annotations

import numpy as np
import torch

_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


ALIGN = 64  # bytes; a multiple of Triton's 16-byte pointer specialization


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """``{name: host array}`` -> ``{name: device tensor}`` (same shapes and dtypes:
    int64, int32, float32 or bool) through one pinned buffer and one copy. Each section
    is one ``as_strided`` view of the buffer viewed once per dtype (a slice and two
    views an array cost 1.6x as much host time: most of this function's)."""
    layout: list[tuple[str, np.ndarray, int, torch.dtype]] = []
    total = 0
    for name, a in arrays.items():
        dtype = _TORCH_DTYPES.get(a.dtype)
        if dtype is None:
            raise TypeError(f"{name}: dtype {a.dtype} cannot be packed")
        layout.append((name, a, total, dtype))
        total = _aligned(total + a.nbytes)
    pin = device.type == "cuda"
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=pin)
    buf = host.numpy()
    for _name, a, off, _dtype in layout:  # any layout in, C order out
        buf[off : off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    dev = host.to(device, non_blocking=True) if pin else host
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, a, off, dtype in layout:
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = dev.view(dtype)  # every section is 64-byte aligned
        out[name] = base.as_strided(a.shape, _contiguous_strides(a.shape), off // a.itemsize)
    return out
