"""Tensors that view memory without keeping it allocated.

A piece captured as a CUDA graph writes its outputs into the graphs' shared memory
pool. Holding those outputs would keep every bucket's activations allocated for good;
holding a view that does not own its storage lets the pool hand the memory to the next
capture, while the view still names the address the graph writes on every replay (the
same trick as Inductor's CUDA-graph trees and vLLM's ``weak_ref_tensors``).
"""

from __future__ import annotations

from typing import Any

import torch


def weak_ref(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s shape, strides, dtype and address that does not own the
    memory: valid only while the memory is not reused for something else."""
    storage = t.untyped_storage()
    base = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    out.set_(base, t.storage_offset(), t.shape, t.stride())  # type: ignore[call-overload]
    return out


def weak_refs(value: Any) -> Any:
    """``weak_ref`` over a tensor or a (nested) tuple/list of tensors; other values as is."""
    if isinstance(value, torch.Tensor):
        return weak_ref(value)
    if isinstance(value, tuple | list):
        return type(value)(weak_refs(v) for v in value)
    return value
