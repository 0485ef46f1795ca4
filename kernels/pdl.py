"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A kernel launched with PDL may start while the kernel before it on the stream is still
running: its programs are placed as soon as every program of that kernel has called
``griddepcontrol.launch_dependents`` (or exited), and they wait in
``griddepcontrol.wait`` until that kernel has finished and its writes are visible. So
the launch gap between two kernels goes, and a kernel can read what the previous one
does not write (a GEMV's weights) before it waits.

The rule every kernel here keeps: each program of a kernel launched with PDL calls
:func:`pdl_enter` before any store and before any load of what an earlier kernel wrote,
on every path (a kernel that finished without waiting would let the next one run ahead
of the kernel before it). :func:`pdl_enter` then releases the next kernel.

On by default where it can run (CUDA, compute capability 9.0+, not the Triton
interpreter); ``KVSCALE_PDL=0`` turns it off (benchmarks compare the two, re-reading the
variable with :func:`reload_switch`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import is_interpreter

_enabled = os.environ.get("KVSCALE_PDL", "1") != "0"


def reload_switch() -> bool:
    """Re-reads ``KVSCALE_PDL`` (``0``: off); returns whether PDL is now allowed."""
    global _enabled
    _enabled = os.environ.get("KVSCALE_PDL", "1") != "0"
    return _enabled


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL: CUDA at compute capability
    9.0+, outside the interpreter, unless ``KVSCALE_PDL=0``."""
    if not _enabled or device.type != "cuda" or is_interpreter():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports(index)


def pdl_launch(device: torch.device) -> dict[str, int | bool]:
    """Launch options of a kernel with a ``PDL`` constexpr on ``device``: the constexpr
    and Triton's ``launch_pdl`` together (the one never without the other), or nothing
    (``PDL`` keeps its default of 0)."""
    return {"PDL": 1, "launch_pdl": True} if pdl_supported(device) else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Waits for the previous kernel on the stream and lets the next one be placed
    (nothing when ``PDL`` is 0); see the module docstring for where to call it."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
