"""Reruns the end-to-end autoscaling scenario and draws its timeline.

The scenario is the one ``tests/autoscaling/test_autoscaling_e2e.py`` asserts on
(:mod:`tests.autoscaling.scenario`): a real Prometheus scraping three ``kvscale serve``
processes on the CPU demo model (32-block KV pools), the operator's autoscaler in
``kopf run`` against the Kubernetes API emulator, and the benchmark client's requests
from a dozen users for 30 s. CPU only, about a minute and a half.

    python bench/autoscale_timeline.py [--out-dir bench/results] [--load-s 30] [--users 12]

Writes ``<out-dir>/autoscale_timeline.png`` (replicas, per-replica KV-cache usage, queue
depth and request rate over time) and ``<out-dir>/autoscale_timeline.json`` (the raw
timeline and its summary). ``--from-json`` redraws the PNG from a saved timeline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The scenario lives with the tests (tests/ is a namespace package at the repo root).
# Appended, not prepended: the stdlib's ``operator`` must win over the repo's operator/.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def _rates(timeline: dict[str, Any], t0: float, end: float) -> tuple[list[float], list[int]]:
    """Completed requests per 1 s bin, from ``t0`` to ``end`` (seconds relative to t0)."""
    bins = [0] * (int(end) + 1)
    for _start, finish, ok in timeline["requests"]:
        i = int(finish - t0)
        if ok and 0 <= i < len(bins):
            bins[i] += 1
    return [i + 0.5 for i in range(len(bins))], bins


def plot(timeline: dict[str, Any], path: Path) -> None:
    """Four stacked panels sharing the time axis (seconds since the load started)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = timeline["params"]
    t0 = timeline["load_start"]
    samples = timeline["samples"]
    t = [s["t"] - t0 for s in samples]
    load_end = timeline["load_end"] - t0
    fig, axes = plt.subplots(4, 1, figsize=(10, 9.5), sharex=True, constrained_layout=True)
    ax_rep, ax_kv, ax_q, ax_rate = axes

    for ax in axes:
        ax.axvspan(0, load_end, color="tab:orange", alpha=0.08, lw=0)
        ax.grid(alpha=0.3)
    ax_rep.step(t, [s["replicas"] for s in samples], where="post", lw=2.2, label="replicas")
    # The recommendation stays high until the last requests are done; the window runs from there.
    window_end = timeline["drained"] - t0 + params["window_s"]
    ax_rep.axvline(window_end, color="gray", ls=":", lw=1)
    ax_rep.text(
        window_end,
        0.35,
        f"last requests done + {params['window_s']} s scale-down window ",
        color="gray",
        fontsize=8,
        ha="right",
    )
    ax_rep.text(0.2, params["max_replicas"] + 0.15, "load", color="tab:orange", fontsize=9)
    ax_rep.set_ylim(0, params["max_replicas"] + 0.8)
    ax_rep.set_yticks(range(params["max_replicas"] + 1))
    ax_rep.set_ylabel("replicas")
    ax_rep.set_title(
        f"Autoscaling on KV-cache usage and queue depth: {params['concurrency']} users for "
        f"{params['load_s']:.0f} s, evaluation every {params['interval_s']} s",
        fontsize=11,
    )

    pods = sorted({name for s in samples for name in s["pods"]})
    for name in pods:
        xs = [ti for ti, s in zip(t, samples, strict=True) if name in s["pods"]]
        ys = [s["pods"][name]["kv"] for s in samples if name in s["pods"]]
        ax_kv.plot(xs, ys, lw=0.8, alpha=0.6, label=name)
    avg_kv = [
        sum(p["kv"] for p in s["pods"].values()) / len(s["pods"]) if s["pods"] else None
        for s in samples
    ]
    ax_kv.plot(t, avg_kv, color="black", lw=2, label="average (ready pods)")
    ax_kv.axhline(params["target_kv_percent"] / 100, color="tab:red", ls="--", lw=1.2)
    ax_kv.text(t[0], params["target_kv_percent"] / 100 + 0.03, " target", color="tab:red")
    ax_kv.set_ylim(-0.03, 1.08)
    ax_kv.set_ylabel("KV-cache usage\n(fraction of blocks)")
    ax_kv.legend(loc="center right", fontsize=8)

    avg_q = [
        sum(p["waiting"] for p in s["pods"].values()) / len(s["pods"]) if s["pods"] else None
        for s in samples
    ]
    ax_q.plot(t, avg_q, color="tab:purple", lw=2, label="waiting requests per replica")
    ax_q.axhline(params["target_queue"], color="tab:red", ls="--", lw=1.2)
    ax_q.text(t[0], params["target_queue"] + 0.3, " target", color="tab:red")
    ax_q.set_ylabel("queue depth\n(per replica)")
    ax_q.legend(loc="center right", fontsize=8)

    xs, rates = _rates(timeline, t0, max(t))
    ax_rate.bar(xs, rates, width=1.0, color="tab:green", alpha=0.6, label="completed req/s")
    ax_rate.plot(t, [s["in_flight"] for s in samples], color="tab:blue", lw=1.5, label="in flight")
    ax_rate.set_ylabel("requests")
    ax_rate.set_xlabel("seconds since the load started")
    ax_rate.legend(loc="center right", fontsize=8)
    ax_rate.set_xlim(min(t), max(t))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--load-s", type=float, default=30.0, help="seconds of load")
    p.add_argument("--users", type=int, default=12, help="concurrent users during the load")
    p.add_argument("--from-json", type=Path, help="redraw from a saved timeline; no run")
    args = p.parse_args(argv)

    from tests.autoscaling.scenario import ScenarioParams, run_scenario
    from tests.autoscaling.timeline import summarize

    if args.from_json:
        timeline = json.loads(args.from_json.read_text())
    else:
        params = ScenarioParams(load_s=args.load_s, concurrency=args.users)
        began = time.time()
        with tempfile.TemporaryDirectory(prefix="kvscale-autoscale-") as tmp:
            timeline = run_scenario(
                Path(tmp),
                params,
                log=lambda m: print(f"[{time.time() - began:5.1f}s] {m}", file=sys.stderr),
            )
        timeline["summary"] = summarize(timeline)
        out = args.out_dir / "autoscale_timeline.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(timeline, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    png = args.out_dir / "autoscale_timeline.png"
    plot(timeline, png)
    print(f"wrote {png}", file=sys.stderr)
    print(json.dumps(summarize(timeline), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
