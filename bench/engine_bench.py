"""Engine benchmarks on one GPU, with the peer (Hugging Face transformers) in the same run.

Model: Llama-3.1-8B shapes with random bf16 weights, written as an HF checkpoint and
loaded through the engine's real loader (and by transformers for the peer). Workloads:

- C, batch-1 latency: a 128-token prompt, 256 output tokens; time per output token
  (TPOT) and time to first token. Peer: ``generate`` (eager, sdpa).
- A, offline throughput: 256 requests of 512 input / 256 output tokens (ignore EOS);
  output tokens/s. Peer: ``generate_batch`` (``--peer-throughput``; it takes ~2 minutes).

Each figure is printed next to the peer's and to the roofline bound computed from the
ceilings measured in the same run (copy bandwidth, bf16 matmul rate).

    python bench/engine_bench.py --out-dir bench/results [--peer-throughput] [--enforce-eager]

The arithmetic (parameter counts, bounds) and the table are plain functions tested on CPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LLAMA_31_8B: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


# ---------------------------------------------------------------- pure arithmetic
def param_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama-style model: embedding, LM head, per-layer, total."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    n = cfg["num_hidden_layers"]
    embed = v * h
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    total = embed + head + n * layer + h
    return {"embed": embed, "lm_head": head, "layers": n * layer, "total": total}


def kv_bytes_per_token(cfg: dict[str, Any], elem_bytes: int = 2) -> int:
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * elem_bytes


def decode_step_floor_s(
    cfg: dict[str, Any], context_tokens: int, copy_bytes_per_s: float, elem_bytes: int = 2
) -> float:
    """One decode step reads every weight but the embedding table once, plus the KV
    cache of all ``context_tokens`` (summed over the batch)."""
    p = param_counts(cfg)
    weight_bytes = (p["total"] - p["embed"]) * elem_bytes
    return (weight_bytes + context_tokens * kv_bytes_per_token(cfg, elem_bytes)) / copy_bytes_per_s


def throughput_bound(
    cfg: dict[str, Any],
    num_requests: int,
    input_len: int,
    output_len: int,
    copy_bytes_per_s: float,
    flop_per_s: float,
) -> dict[str, float]:
    """Roofline for an offline batch: the slower of compute (every token through every
    matmul, attention included) and memory (``output_len`` decode steps of the whole
    batch, each reading the weights and the batch's KV cache). Returns seconds and the
    output tokens/s bound."""
    p = param_counts(cfg)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    tokens = num_requests * (input_len + output_len)
    linear = 2 * p["layers"] * tokens + 2 * p["lm_head"] * num_requests * output_len
    # causal attention: each token attends to its prefix (QK^T and PV, 2 flops per MAC)
    pairs = num_requests * sum(range(1, input_len + output_len + 1))
    attention = 4 * pairs * h * n_layers
    compute_s = (linear + attention) / flop_per_s
    avg_ctx = num_requests * (input_len + output_len / 2)
    memory_s = output_len * decode_step_floor_s(cfg, int(avg_ctx), copy_bytes_per_s)
    bound_s = max(compute_s, memory_s)
    return {
        "compute_s": compute_s,
        "memory_s": memory_s,
        "bound_s": bound_s,
        "output_tok_per_s": num_requests * output_len / bound_s,
    }


@dataclass
class Row:
    workload: str
    metric: str
    ours: float
    peer: float | None
    bound: float | None
    higher_is_better: bool
    target: str


def format_table(rows: list[Row]) -> str:
    """Markdown: ours, peer, ratio (how many times better we are), bound, fraction."""
    lines = [
        "| workload | metric | kvscale | peer | kvscale vs peer | roofline bound | "
        "fraction of bound | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = frac = "n/a"
        if r.peer:
            x = r.ours / r.peer if r.higher_is_better else r.peer / r.ours
            ratio = f"{x:.2f}x"
        if r.bound:
            f = r.ours / r.bound if r.higher_is_better else r.bound / r.ours
            frac = f"{100 * f:.1f}%"
        peer = f"{r.peer:.2f}" if r.peer is not None else "not run"
        bound = f"{r.bound:.2f}" if r.bound is not None else "n/a"
        lines.append(
            f"| {r.workload} | {r.metric} | {r.ours:.2f} | {peer} | {ratio} | {bound} | "
            f"{frac} | {r.target} |"
        )
    return "\n".join(lines)


def summarize_steps(steps: list[tuple[float, float, int, int]]) -> dict[str, Any]:
    """Per-step ``(step_s, execute_s, decode_rows, prefill_tokens)`` -> where time went:
    counts and mean times (ms) of pure-decode and mixed/prefill steps, and the mean host
    time outside ``execute`` (scheduling, bookkeeping) per step."""
    decode = [x for x in steps if x[3] == 0]
    mixed = [x for x in steps if x[3] > 0]

    def mean_ms(xs: list[float]) -> float:
        return 1e3 * statistics.fmean(xs) if xs else 0.0

    return {
        "num_steps": len(steps),
        "decode_steps": len(decode),
        "decode_step_ms": mean_ms([x[0] for x in decode]),
        "decode_execute_ms": mean_ms([x[1] for x in decode]),
        "decode_mean_batch": statistics.fmean(x[2] for x in decode) if decode else 0.0,
        "prefill_steps": len(mixed),
        "prefill_step_ms": mean_ms([x[0] for x in mixed]),
        "host_outside_execute_ms": mean_ms([x[0] - x[1] for x in steps]),
        "total_step_s": sum(x[0] for x in steps),
    }


# ---------------------------------------------------------------- GPU runs
def _instrument(eng: Any) -> list[tuple[float, float, int, int]]:
    """Wraps the engine's step and the runner's execute with timers (adds ~1 us)."""
    steps: list[tuple[float, float, int, int]] = []
    last: dict[str, Any] = {}
    execute, step = eng.runner.execute, eng.step

    def timed_execute(batch: Any, banned: Any) -> Any:
        t0 = time.perf_counter()
        out = execute(batch, banned)
        last["exec"] = time.perf_counter() - t0
        n = batch.num_new_tokens
        last["decode"] = sum(1 for x in n if x == 1)
        last["prefill"] = sum(x for x in n if x > 1)
        return out

    def timed_step() -> Any:
        t0 = time.perf_counter()
        last.clear()
        out = step()
        if last:
            steps.append((time.perf_counter() - t0, last["exec"], last["decode"], last["prefill"]))
        return out

    eng.runner.execute, eng.step = timed_execute, timed_step
    return steps


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, 32000, (length - 1,), generator=g).tolist()] for _ in range(n)]


def run_ours(ckpt: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvscale.server import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        str(ckpt),
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=256,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=0.9,
    )
    load_s = time.perf_counter() - t0
    eng = llm.engine
    res: dict[str, Any] = {"load_s": load_s, "kv_blocks": eng.block_manager.num_blocks}
    # C: batch-1 latency
    tpots, ttfts = [], []
    prompt = _prompts(1, 128, 0)[0]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"lat{i}", prompt, params)
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
        assert out is not None and len(out.outputs[0].token_ids) == 256
        m = out.metrics
        if i == 0:
            continue  # warm-up
        ttfts.append(m["first_token_time"] - m["arrival_time"])
        tpots.append((m["finished_time"] - m["first_token_time"]) / 255)
    res["latency"] = {
        "tpot_ms": 1e3 * statistics.median(tpots),
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "runs": len(tpots),
    }
    # A: offline throughput
    prompts = _prompts(256, 512, 1)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    steps = _instrument(eng)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    res["steps"] = summarize_steps(steps)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res["throughput"] = {
        "wall_s": wall,
        "output_tokens": n_out,
        "output_tok_per_s": n_out / wall,
        "total_tok_per_s": (n_out + 256 * 512) / wall,
        "preemptions": eng.stats().num_preemptions,
    }
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    return res


def run_peer_latency(ckpt: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    prompt = torch.tensor([_prompts(1, 128, 0)[0]], device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n: int, model: Any = model) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(8)  # warm-up
    ttft = statistics.median(timed(1) for _ in range(3))
    full = timed(256)
    res = {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * (full - ttft) / 255}
    del model, timed
    gc.collect()
    torch.cuda.empty_cache()
    return res


def run_peer_throughput(ckpt: Path) -> dict[str, Any]:
    """transformers' continuous-batching ``generate_batch`` (paged attention) on A."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).cuda()
    cfg = GenerationConfig(
        max_new_tokens=256, min_new_tokens=256, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    prompts = _prompts(256, 512, 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n_out = sum(len(r.generated_tokens) for r in results.values())
    del model, results
    gc.collect()
    torch.cuda.empty_cache()
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_per_s": n_out / wall}


def run_serving(ckpt: Path, out_dir: Path, concurrencies: list[int]) -> dict[str, Any]:
    """Workload D: ``kvscale serve`` under ``kvscale bench serve`` (ShareGPT-like lengths)."""
    import os
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONSAFEPATH="1")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvscale.cli",
            "serve",
            "--model",
            str(ckpt),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--disable-access-log",
            "--log-level",
            "warning",
        ],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{base}/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"kvscale serve exited with {server.returncode}")
            time.sleep(1)
        else:
            raise RuntimeError("kvscale serve did not become ready in 300 s")
        results = {}
        for c in concurrencies:
            n = max(16, 2 * c)
            path = out_dir / f"serve_c{c}.json"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvscale.cli",
                    "bench",
                    "serve",
                    "--base-url",
                    base,
                    "--dataset",
                    "sharegpt-like",
                    "--num-prompts",
                    str(n),
                    "--request-rate",
                    "inf",
                    "--max-concurrency",
                    str(c),
                    "--seed",
                    "0",
                    "--result-file",
                    str(path),
                    "--disable-tqdm",
                ],
                env=env,
                check=True,
                timeout=600,
            )
            results[c] = json.loads(path.read_text())
            print(
                f"serve c={c}: {results[c]['output_throughput']:.0f} tok/s, median TPOT "
                f"{results[c]['median_tpot_ms']:.1f} ms, failed {results[c]['failed_requests']}",
                flush=True,
            )
        return results
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def plot_serving(results: dict[int, dict[str, Any]], path: Path, title: str) -> None:
    """Output throughput and median/p99 TPOT against concurrency, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = sorted(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(cs, [results[c]["output_throughput"] for c in cs], "o-")
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    b.plot(cs, [results[c]["median_tpot_ms"] for c in cs], "o-", label="median")
    b.plot(cs, [results[c]["p99_tpot_ms"] for c in cs], "s--", label="p99")
    b.set(xscale="log", xlabel="concurrency", ylabel="ms", title="time per output token")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--ckpt", default="/tmp/llama31-8b-random")
    ap.add_argument(
        "--peer-throughput",
        action="store_true",
        help="also run transformers' generate_batch on workload A (~2 min)",
    )
    ap.add_argument("--no-peer", action="store_true", help="skip the peer entirely")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--serve", default="", help="workload D concurrencies, e.g. 1,16,64,256")
    args = ap.parse_args(argv)

    import torch
    import transformers
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernels import Bench  # bench/kernels.py: the ceilings
    from kvscale.server.demo_model import write_random_checkpoint

    ckpt = Path(args.ckpt)
    if not (ckpt / "model.safetensors.index.json").is_file():
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, "llama", LLAMA_31_8B, dtype="bfloat16", device="cuda")
        print(f"wrote the 8B-shaped checkpoint in {time.perf_counter() - t0:.0f}s", flush=True)
    bench = Bench(quick=False)
    ceil = bench.ceilings()
    copy_bps, flops = ceil["copy"] * 1e9, ceil["matmul"] * 1e12
    print(f"ceilings: copy {ceil['copy']:.0f} GB/s, matmul {ceil['matmul']:.0f} TFLOP/s")
    ours = run_ours(ckpt, args)
    print("kvscale:", json.dumps(ours), flush=True)
    peer: dict[str, Any] = {}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    serving: dict[int, dict[str, Any]] = {}
    if args.serve:
        try:
            serving = run_serving(ckpt, out, [int(c) for c in args.serve.split(",")])
        except (RuntimeError, OSError, ValueError) as e:  # report, keep the other workloads
            print(f"workload D failed: {e!r}", flush=True)
    if not args.no_peer:
        peer["latency"] = run_peer_latency(ckpt)
        print("peer:", json.dumps(peer), flush=True)
    if args.peer_throughput:
        peer["throughput"] = run_peer_throughput(ckpt)
        print("peer:", json.dumps(peer), flush=True)
    cfg = LLAMA_31_8B
    floor_ms = 1e3 * decode_step_floor_s(cfg, 128 + 128, copy_bps)
    bound_a = throughput_bound(cfg, 256, 512, 256, copy_bps, flops)
    rows = [
        Row(
            "C batch-1 latency",
            "TPOT (ms)",
            ours["latency"]["tpot_ms"],
            peer.get("latency", {}).get("tpot_ms"),
            floor_ms,
            False,
            "<= 7.0 ms",
        ),
        Row(
            "C batch-1 latency",
            "TTFT (ms)",
            ours["latency"]["ttft_ms"],
            peer.get("latency", {}).get("ttft_ms"),
            None,
            False,
            "",
        ),
        Row(
            "A 256 x 512/256",
            "output tok/s",
            ours["throughput"]["output_tok_per_s"],
            peer.get("throughput", {}).get("output_tok_per_s"),
            bound_a["output_tok_per_s"],
            True,
            ">= 6000 and >= 10x peer",
        ),
    ]
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cuda_graphs": not args.enforce_eager,
        "params": param_counts(cfg)["total"],
    }
    for c, r in sorted(serving.items()):
        rows.append(
            Row(
                f"D serve c={c}",
                "median TPOT (ms)",
                r["median_tpot_ms"],
                None,
                None,
                False,
                "<= 12 ms at c=64" if c == 64 else "",
            )
        )
        rows.append(
            Row(
                f"D serve c={c}",
                "output tok/s",
                r["output_throughput"],
                None,
                None,
                True,
                f"failed {r['failed_requests']}",
            )
        )
    table = format_table(rows)
    print(table)
    if serving:
        plot_serving(
            serving,
            out / "serving.png",
            f"kvscale serve, Llama-3.1-8B shapes, {meta['gpu']}, {meta['date']}",
        )
    (out / "engine.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "ceilings": ceil,
                "bounds": {"C_tpot_floor_ms": floor_ms, "A": bound_a},
                "kvscale": ours,
                "peer": peer,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    (out / "engine.md").write_text(
        f"# Engine benchmarks\n\n{header}\n- ceilings: copy "
        f"{ceil['copy']:.0f} GB/s, matmul {ceil['matmul']:.0f} "
        f"TFLOP/s\n\n{table}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
