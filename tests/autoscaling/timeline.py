"""Reading a replica timeline: scale events, direction changes (flapping)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


def direction_changes(series: Sequence[int]) -> int:
    """How often the replica count turned around (up then down counts 1)."""
    steps = [b - a for a, b in itertools.pairwise(series) if b != a]
    return sum(1 for a, b in itertools.pairwise(steps) if (a > 0) != (b > 0))


def changes(times: Sequence[float], series: Sequence[int]) -> list[tuple[float, int, int]]:
    """``(time, before, after)`` for every change of the count."""
    return [
        (t, a, b) for t, (a, b) in zip(times[1:], itertools.pairwise(series), strict=True) if a != b
    ]


def summarize(timeline: dict[str, Any]) -> dict[str, Any]:
    """What the e2e test asserts and the bench script prints (seconds, counts)."""
    samples = timeline["samples"]
    times = [s["t"] for s in samples]
    reps = [int(s["replicas"] or 0) for s in samples]
    start, end = timeline["load_start"], timeline["load_end"]
    steps = changes(times, reps)
    first_up = next((t for t, a, b in steps if b > a and t >= start), None)
    first_down = next((t for t, a, b in steps if b < a and t > start), None)
    kv = [v["kv"] for s in samples for v in s["pods"].values() if v["kv"] is not None]
    waiting = [v["waiting"] for s in samples for v in s["pods"].values() if v["waiting"]]
    ok = sum(1 for r in timeline["requests"] if r[2])
    return {
        "scale_up_after_s": None if first_up is None else first_up - start,
        "scale_down_after_load_end_s": None if first_down is None else first_down - end,
        "max_replicas": max(reps),
        "final_replicas": reps[-1],
        "decreases_during_load": sum(1 for t, a, b in steps if b < a and start <= t <= end),
        "direction_changes": direction_changes(reps),
        "scalings": [(round(t - start, 1), a, b) for t, a, b in steps],
        "max_pod_kv": max(kv, default=0.0),
        "max_pod_waiting": max(waiting, default=0.0),
        "requests_ok": ok,
        "requests_failed": len(timeline["requests"]) - ok,
    }
