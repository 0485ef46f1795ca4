"""Where a speculative step's time goes at batch 1, on CUDA with the 8B-shaped checkpoint.

For each configuration (``--configs``: ``echo-none``, ``echo-ngram``, ``none``, ``ngram``
on the damped random target, ``draft`` the in-process draft pair; see ``spec_bench``), one
request of ``spec_bench.OUT_LEN`` tokens is decoded twice:

1. timed per ``step()`` call: the proposer's host time, the rest of the host's work
   before the step is launched (scheduling, building the step), the worker's launch
   (enqueueing the forward pass and the sampling), the wait for the step's tokens, and
   what follows (emitting the tokens); the GPU idles for everything but the wait and
   what the launch overlaps, so a step's cost beyond the forward pass is visible here;
2. under cProfile: the host functions that take the time (top ``--top`` by own time);
3. with ``--trace DIR``: ``--trace-steps`` steps under ``torch.profiler``, each phase of
   step 1 a labelled range, written as a Chrome trace (``DIR/<config>.json``) and
   summarised: per phase, its wall time and the GPU's busy time inside it (the union of
   kernel intervals), so the GPU's idle time shows where the host holds it up.

    python bench/profile_spec.py [--ckpt /tmp/llama31-8b-random] [--configs echo-ngram,ngram]
        [--trace DIR --trace-steps 12]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("damped", {}),
    "ngram": ("damped", dict(speculative_method="ngram")),
    "echo-none": ("echo", {}),
    "echo-ngram": ("echo", dict(speculative_method="ngram")),
    "draft": ("damped", dict(speculative_method="draft")),
}


def _timers(core: Any, detail: bool = False) -> tuple[dict[str, float], Any]:
    """Wraps the core's proposer, scheduler and worker calls with timers (ms, summed per
    step into the returned dict); returns it and an undo function. ``detail``: also the
    parts of the target's launch and of an in-process draft's propose (nested inside
    those: they overlap the phases above)."""
    from torch.profiler import record_function

    from kvscale.server.worker.worker import PendingStep

    cur: dict[str, float] = {}
    undo = []

    def wrap(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)
        own = name in vars(obj)  # else a method: restoring deletes the wrapper (no cycle)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                with record_function(f"phase:{key}"):
                    return fn(*a, **kw)
            finally:
                cur[key] = cur.get(key, 0.0) + 1e3 * (time.perf_counter() - t0)

        setattr(obj, name, timed)
        undo.append(lambda: setattr(obj, name, fn) if own else delattr(obj, name))

    if core.speculator is not None:
        wrap(core.speculator, "draft", "propose")
        wrap(core.speculator, "stage", "propose")
    wrap(core.scheduler, "schedule", "schedule")
    wrap(core.worker, "launch", "launch")
    if detail:
        from kvscale.server.engine import engine_core
        from kvscale.server.worker import worker as worker_module

        wrap(engine_core, "build_step", "d.build_step")
        wrap(worker_module, "to_device", "d.to_device")
        wrap(worker_module, "_place_drafts", "d.place_drafts")
        wrap(core.worker, "_enqueue_forward", "d.target_forward")
        wrap(core.worker, "_sample", "d.target_sample")
        if core.worker.graphs is not None:
            wrap(core.worker.graphs, "run", "d.target_graph_run")
        runner = core.speculator.proposer if core.speculator is not None else None
        if runner is not None and hasattr(runner, "_catch_up"):
            for name in ("_plan", "_catch_up", "_decode", "_draw", "_settle"):
                wrap(runner, name, f"d.draft{name}")
            wrap(runner.worker, "forward", "d.draft_forward")
    result = PendingStep.result

    def timed_result(self: Any) -> Any:
        t0 = time.perf_counter()
        with record_function("phase:wait"):
            out = result(self)
        cur["wait"] = cur.get("wait", 0.0) + 1e3 * (time.perf_counter() - t0)
        return out

    PendingStep.result = timed_result  # type: ignore[method-assign]
    undo.append(lambda: setattr(PendingStep, "result", result))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return cur, restore


def profile_config(llm: Any, repeat: bool, top: int, detail: bool = False) -> dict[str, Any]:
    """One request decoded step by step, timed (``detail``: see ``_timers``); then again
    under cProfile."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spec_bench import OUT_LEN, _prompts

    from kvscale.server import SamplingParams

    eng = llm.engine
    prompt = _prompts(1, repeat)
    sp = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    llm.generate(prompt, sp)  # warm-up
    cur, restore = _timers(eng.core, detail)
    rows = []
    try:
        eng.queue("p0", prompt[0], eng.prepare(prompt[0], sp), sp)
        for _ in range(4 * OUT_LEN):
            cur.clear()
            before = eng.core._generation_tokens
            t0 = time.perf_counter()
            outs = eng.step()
            cur["step"] = 1e3 * (time.perf_counter() - t0)
            cur["tokens"] = float(eng.core._generation_tokens - before)
            rows.append(dict(cur))
            if any(o.finished for o in outs):
                break
    finally:
        restore()
    steps = rows[2:]  # past the prefill
    keys = ("step", "propose", "schedule", "launch", "wait", "tokens")
    mean = {k: statistics.fmean(r.get(k, 0.0) for r in steps) for k in keys}
    parts = ("propose", "schedule", "launch", "wait")
    mean["other_host"] = mean["step"] - sum(mean[k] for k in parts)
    for k in sorted({k for r in steps for k in r} - set(mean)):  # the detail timers
        mean[k] = statistics.fmean(r.get(k, 0.0) for r in steps)
    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompt, sp)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return {"steps": len(steps), "ms_per_step": mean, "cprofile": buf.getvalue()}


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of ``(start, end)`` spans."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def phase_busy(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """From a Chrome trace's events: per ``phase:*`` range name, the summed wall time
    (us), the GPU's busy time inside those ranges (the union of kernel, copy and memset
    intervals, clipped to each range) and how many ranges there were. Nested ranges
    count in each of their names."""
    gpu = _merged(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        ]
    )
    out: dict[str, dict[str, float]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        if not name.startswith("phase:"):
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        busy = sum(max(0.0, min(b, y) - max(a, x)) for x, y in gpu if x < b and y > a)
        zero = {"wall_us": 0.0, "gpu_busy_us": 0.0, "n": 0}
        row = out.setdefault(name.removeprefix("phase:"), zero)
        row["wall_us"] += b - a
        row["gpu_busy_us"] += busy
        row["n"] += 1
    return out


def trace_config(llm: Any, repeat: bool, steps: int, path: Path) -> str:
    """``steps`` decode steps of one request under ``torch.profiler`` (phases labelled),
    written to ``path`` as a Chrome trace; returns the per-phase summary."""
    import json

    from spec_bench import OUT_LEN, _prompts
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvscale.server import SamplingParams

    eng = llm.engine
    prompt = _prompts(1, repeat)
    sp = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    _, restore = _timers(eng.core)
    finished = False
    try:
        eng.queue("trace", prompt[0], eng.prepare(prompt[0], sp), sp)
        for _ in range(3):  # the prefill and the first decodes, outside the trace
            finished |= any(o.finished for o in eng.step())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                if finished:
                    break
                with record_function("phase:step"):
                    finished |= any(o.finished for o in eng.step())
        for _ in range(4 * OUT_LEN):  # the rest of the request, untraced
            if finished:
                break
            finished |= any(o.finished for o in eng.step())
    finally:
        restore()
    prof.export_chrome_trace(str(path))
    rows = phase_busy(json.loads(path.read_text())["traceEvents"])
    lines = [f"trace {path.name}: per phase, summed over the traced steps (ms)"]
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["wall_us"]):
        idle = r["wall_us"] - r["gpu_busy_us"]
        lines.append(
            f"  {name:10s} x{r['n']:3d}: wall {r['wall_us'] / 1e3:8.3f}, GPU busy "
            f"{r['gpu_busy_us'] / 1e3:8.3f}, GPU idle {idle / 1e3:8.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/llama31-8b-random")
    ap.add_argument("--configs", default="echo-none,echo-ngram,none,ngram,draft")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace", help="also write and summarise a torch.profiler trace here")
    ap.add_argument("--trace-steps", type=int, default=12)
    ap.add_argument("--skip-timed", action="store_true", help="the trace only")
    ap.add_argument("--detail", action="store_true", help="time the launch's and propose's parts")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from engine_bench import _close, _llm, ensure_checkpoint
    from spec_bench import K, damp_deep_layers, make_echo, write_draft_checkpoint

    ckpt = Path(args.ckpt)
    ensure_checkpoint(ckpt)
    for name in args.configs.split(","):
        target, kw = CONFIGS[name]
        if name == "draft":
            draft = write_draft_checkpoint(ckpt, ckpt.parent / f"{ckpt.name}-draft2")
            kw = {**kw, "speculative_model": str(draft)}
        llm = _llm(ckpt, num_speculative_tokens=K, gpu_memory_utilization=0.75, **kw)
        (make_echo if target == "echo" else damp_deep_layers)(llm)
        if not args.skip_timed:
            res = profile_config(llm, repeat=True, top=args.top, detail=args.detail)
            m = res["ms_per_step"]
            print(
                f"==== {name} on the {target} target, batch 1, {res['steps']} steps: per "
                + "step "
                + ", ".join(f"{k} {v:.3f}" for k, v in m.items())
                + f" ms; {m['step'] / max(m['tokens'], 1e-9):.3f} ms a token",
                flush=True,
            )
            print(res["cprofile"], flush=True)
        if args.trace:
            out = Path(args.trace)
            out.mkdir(parents=True, exist_ok=True)
            print(trace_config(llm, True, args.trace_steps, out / f"{name}.json"), flush=True)
        _close(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
