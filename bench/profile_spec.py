"""Where a speculative step's time goes at batch 1, on CUDA with the 8B-shaped checkpoint.

For each configuration (``--configs``: ``echo-none``, ``echo-ngram``, ``none``, ``ngram``
on the damped random target, ``draft`` the in-process draft pair; see ``spec_bench``), one
request of ``spec_bench.OUT_LEN`` tokens is decoded twice:

1. timed per ``step()`` call: the proposer's host time, the rest of the host's work
   before the step is launched (scheduling, building the step), the worker's launch
   (enqueueing the forward pass and the sampling), the wait for the step's tokens, and
   what follows (emitting the tokens); the GPU idles for everything but the wait and
   what the launch overlaps, so a step's cost beyond the forward pass is visible here;
2. under cProfile: the host functions that take the time (top ``--top`` by own time).

    python bench/profile_spec.py [--ckpt /tmp/llama31-8b-random] [--configs echo-ngram,ngram]
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


def _timers(core: Any) -> tuple[dict[str, float], Any]:
    """Wraps the core's proposer, scheduler and worker calls with timers (ms, summed per
    step into the returned dict); returns it and an undo function."""
    from kvscale.server.worker.worker import PendingStep

    cur: dict[str, float] = {}
    undo = []

    def wrap(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)
        own = name in vars(obj)  # else a method: restoring deletes the wrapper (no cycle)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
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
    result = PendingStep.result

    def timed_result(self: Any) -> Any:
        t0 = time.perf_counter()
        out = result(self)
        cur["wait"] = cur.get("wait", 0.0) + 1e3 * (time.perf_counter() - t0)
        return out

    PendingStep.result = timed_result  # type: ignore[method-assign]
    undo.append(lambda: setattr(PendingStep, "result", result))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return cur, restore


def profile_config(llm: Any, repeat: bool, top: int) -> dict[str, Any]:
    """One request decoded step by step, timed; then again under cProfile."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spec_bench import OUT_LEN, _prompts

    from kvscale.server import SamplingParams

    eng = llm.engine
    prompt = _prompts(1, repeat)
    sp = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    llm.generate(prompt, sp)  # warm-up
    cur, restore = _timers(eng.core)
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
    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompt, sp)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return {"steps": len(steps), "ms_per_step": mean, "cprofile": buf.getvalue()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/llama31-8b-random")
    ap.add_argument("--configs", default="echo-none,echo-ngram,none,ngram,draft")
    ap.add_argument("--top", type=int, default=30)
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
        res = profile_config(llm, repeat=True, top=args.top)
        m = res["ms_per_step"]
        print(
            f"==== {name} on the {target} target, batch 1, {res['steps']} steps: per step "
            + ", ".join(f"{k} {v:.3f}" for k, v in m.items())
            + f" ms; {m['step'] / max(m['tokens'], 1e-9):.3f} ms a token",
            flush=True,
        )
        print(res["cprofile"], flush=True)
        _close(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
