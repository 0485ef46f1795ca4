"""The CUDA work of a ``torch.profiler`` run with each kernel's launch grid.

The profiler's events carry a kernel's name and time but not its launch shape, and one
cuBLAS kernel name can run with different grids (another split-K factor or tile count:
NOTES e65, where cuBLAS and cuBLASLt launched kernels of the same names at different
speeds). Kineto's Chrome trace has the grid in each kernel event's ``args``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

# Chrome-trace categories of the device's work: kernels, copies, fills
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_CHARS = 90
GRID = " [grid "


def short(name: str) -> str:
    """A kernel's name cut to ``NAME_CHARS`` characters; a launch grid after it, as
    :func:`label` writes it, is kept."""
    base, grid, shape = name.partition(GRID)
    return base[:NAME_CHARS] + grid + shape


def label(name: str, grid: list[int] | None) -> str:
    """``name`` cut to ``NAME_CHARS`` characters, then `` [grid X,Y,Z]`` where known."""
    if not grid:
        return short(name)
    return f"{short(name)}{GRID}{','.join(str(g) for g in grid)}]"


def events_from_trace(trace: dict[str, Any]) -> list[tuple[str, float, float]]:
    """``(label, start_us, duration_us)`` of each device event of a Chrome trace, in
    trace order."""
    return [
        (
            label(e["name"], e.get("args", {}).get("grid")),
            float(e.get("ts", 0.0)),
            float(e.get("dur", 0.0)),
        )
        for e in trace.get("traceEvents", [])
        if e.get("cat") in DEVICE_CATEGORIES
    ]


def kernels_from_trace(trace: dict[str, Any]) -> list[tuple[str, float]]:
    """``(label, microseconds)`` of each device event of a Chrome trace, in trace order."""
    return [(name, dur) for name, _, dur in events_from_trace(trace)]


def idle_gaps(events: list[tuple[str, float, float]]) -> dict[tuple[str, str], list[float]]:
    """Where the device idled: for each event (by start time) that began after every
    earlier one had ended, the gap (us) since the latest end, keyed by (the event that
    ended latest, the event that began). Overlapping events leave no gap."""
    gaps: dict[tuple[str, str], list[float]] = {}
    last_name, last_end = None, float("-inf")
    for name, start, dur in sorted(events, key=lambda e: e[1]):
        if last_name is not None and start > last_end:
            gaps.setdefault((last_name, name), []).append(start - last_end)
        if start + dur >= last_end:
            last_name, last_end = name, start + dur
    return gaps


def trace_of(prof: Any) -> dict[str, Any]:
    """The Chrome trace of a finished ``torch.profiler.profile``, as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())  # type: ignore[no-any-return]


def cuda_kernels(prof: Any) -> list[tuple[str, float]]:
    """:func:`kernels_from_trace` of a finished ``torch.profiler.profile``."""
    return kernels_from_trace(trace_of(prof))
