"""How a tensor-parallel engine's process ends, on 2 GPUs (issue 24; diagnosis).

Lease r19 (2 x H200): processes that had run TP=2 engines ended in "terminate called
without an active exception" (exit 134), and a TP=2 ``kvscale serve`` engine process did
not stop within 10 s of SIGTERM. r19b ran this script: in every variant, one-shot or
NCCL only, ``leave_group`` waited out its whole 10 s (``destroy_process_group`` hung), and
skipping it made the shutdown take 0.27 s: NCCL's teardown waits for the CUDA graphs that
hold its collectives (pytorch#115388). The engine now drops its graphs first
(``Worker.release_graphs``); ``keep-graphs`` does not, to show the difference.

Per variant, in a process of its own, an ``LLM`` at TP=2 on a small random checkpoint
generates, shuts its engine down and exits; printed: the exit code, the seconds the
shutdown and its ``leave_group`` took, the symmetric-memory backend, whether "terminate
called" was printed, and for a process still alive after ``--hang-s`` py-spy's native
stacks of it and its children (then it is killed).

    python bench/tp_shutdown.py [--out-dir DIR] [--variants one-shot,nccl,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "one-shot": "the default: the one-shot all-reduce on",
    "nccl": "--disable-custom-all-reduce: NCCL only",
    "keep-graphs": "the one-shot all-reduce on, the CUDA graphs kept through the shutdown",
    "no-leave": "the one-shot all-reduce on, the shutdown skips leave_group",
}


def child(path: str, variant: str) -> None:
    """One TP=2 engine: generate, shut down, exit (a line of JSON on stdout)."""
    import torch

    import kvscale.server.distributed.driver as driver
    from kvscale.server import LLM, SamplingParams

    times: dict[str, float] = {}
    leave = driver.leave_group

    def timed_leave(*a: object, **kw: object) -> None:
        t = time.monotonic()
        if variant != "no-leave":
            leave(*a, **kw)
        times["leave_group_s"] = time.monotonic() - t

    driver.leave_group = timed_leave
    if variant == "keep-graphs":
        from kvscale.server.worker.worker import Worker

        Worker.release_graphs = lambda self: None  # type: ignore[method-assign]
    llm = LLM(path, device="cuda", dtype="bfloat16", tensor_parallel_size=2,
              disable_custom_all_reduce=variant == "nccl")  # fmt: skip
    parallel = llm.engine.worker.worker.parallel
    backend = None
    if parallel.one_shot is not None:
        import torch.distributed._symmetric_memory as symm_mem

        backend = symm_mem.get_backend(torch.device("cuda", 0))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]] * 4, params)
    t = time.monotonic()
    llm.engine.core.shutdown()
    times["shutdown_s"] = time.monotonic() - t
    left = not torch.distributed.is_initialized()
    print(json.dumps({"one_shot": backend is not None, "backend": backend, "left_group": left,
                      **times}), flush=True)  # fmt: skip


def native_stacks(pid: int) -> str:
    """py-spy's native stacks of ``pid`` and its children."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    out = []
    for p in [pid, *map(int, kids.split())]:
        r = subprocess.run(["py-spy", "dump", "--native", "--pid", str(p)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        out.append(f"--- pid {p}\n{r.stdout}{r.stderr}")
    return "\n".join(out)


def run_variant(path: str, variant: str, hang_s: float) -> dict:
    env = dict(os.environ)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, "--child", path, variant], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    stacks = None
    try:
        out, err = proc.communicate(timeout=hang_s)
    except subprocess.TimeoutExpired:
        stacks = native_stacks(proc.pid)
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
        proc.kill()
        out, err = proc.communicate()
    line = next((x for x in out.splitlines() if x.startswith("{")), None)
    return {
        "variant": variant,
        "what": VARIANTS[variant],
        "exit_code": proc.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "terminate_called": "terminate called" in err,
        "child": json.loads(line) if line else None,
        "stderr_tail": err[-1500:],
        "native_stacks": stacks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("PATH", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hang-s", type=float, default=90.0)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    from kvscale.server.demo_model import build_checkpoint

    path = str(build_checkpoint(tempfile.mkdtemp(prefix="tp-shutdown-"), arch="llama"))
    results = []
    for v in args.variants.split(","):
        r = run_variant(path, v, args.hang_s)
        results.append(r)
        brief = {k: r[k] for k in ("variant", "exit_code", "wall_s", "terminate_called", "child")}
        print(json.dumps(brief), flush=True)
        if r["native_stacks"]:
            print(r["native_stacks"][-6000:], flush=True)
    Path(args.out_dir, "tp_shutdown.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
