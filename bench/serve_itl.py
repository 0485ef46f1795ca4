"""Where a serving run's time per output token goes: its inter-token latencies split into
the steps that ran at the decode pace and the slow ones (NOTES e101).

A request's TPOT is the mean of its inter-token latencies. At a steady concurrency most
of them are one decode step; a step that also carries a prompt's prefill (a mixed step)
or waits on the host shows up as a longer one in every request running through it. From
``kvscale bench serve --save-detailed`` results (``itls`` per request, seconds) this
splits each request's latencies at ``slow_factor`` x the run's median latency and
reports, per request (means over requests), how many slow latencies it saw, how long
they and the fast ones took, and the share of its decode time they hold: what separates
two servers whose median TPOTs differ.

    python bench/serve_itl.py RESULT.json [RESULT.json ...] [--slow-factor 1.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def itl_profile(itls: list[list[float]], slow_factor: float = 1.5) -> dict[str, float]:
    """``itls``: each request's inter-token latencies (s). Returns, in ms and counts: the
    run's median latency, the slow threshold, and per-request means of the slow count,
    the slow and fast latencies' means (over requests that have any) and the slow share
    of the decode time."""
    flat = [x for r in itls for x in r]
    if not flat:
        raise ValueError("no inter-token latencies: run the client with --save-detailed")
    median = statistics.median(flat)
    limit = slow_factor * median
    slow_n, slow_ms, fast_ms, share = [], [], [], []
    for r in itls:
        if not r:
            continue
        slow = [x for x in r if x > limit]
        fast = [x for x in r if x <= limit]
        slow_n.append(len(slow))
        share.append(sum(slow) / sum(r))
        if slow:
            slow_ms.append(1e3 * statistics.mean(slow))
        if fast:
            fast_ms.append(1e3 * statistics.mean(fast))

    def mean(xs: list[float]) -> float:
        return statistics.mean(xs) if xs else 0.0

    return {
        "median_itl_ms": 1e3 * median,
        "slow_limit_ms": 1e3 * limit,
        "slow_per_request": mean(slow_n),
        "slow_itl_ms": mean(slow_ms),
        "fast_itl_ms": mean(fast_ms),
        "slow_share": mean(share),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="kvscale bench serve --save-detailed JSON files")
    ap.add_argument("--slow-factor", type=float, default=1.5)
    args = ap.parse_args(argv)
    cols = ("median_itl_ms", "slow_per_request", "slow_itl_ms", "fast_itl_ms", "slow_share")
    print("| run | median TPOT (ms) | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * (len(cols) + 1))
    for path in args.results:
        res: dict[str, Any] = json.loads(Path(path).read_text())
        prof = itl_profile(res.get("itls", []), args.slow_factor)
        cells = [f"{res['median_tpot_ms']:.2f}"] + [f"{prof[c]:.2f}" for c in cols]
        print(f"| {path} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
