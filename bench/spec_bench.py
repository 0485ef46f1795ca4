"""Speculative decoding on the 8B-shaped checkpoint (``engine_bench.py --phases spec``).

Random weights make a draft and its target disagree, so the bench builds an honest pair
from the one checkpoint:

- target: the 8B-shaped model with the output projections (``o_proj``, ``down_proj``) of
  every layer after the first ``DRAFT_LAYERS`` scaled by ``DEEP_SCALE``, in memory after
  loading: its deeper layers still run in full (the same bytes and FLOPs per step) but
  move the residual stream little;
- draft: a checkpoint of the first ``DRAFT_LAYERS`` layers with the same embedding,
  final norm and head (``write_draft_checkpoint``), so it agrees with the target often,
  by a measured rate.

A real pair (Llama-3.2-1B drafting for Llama-3.1-8B) agrees less on free text (vLLM and
EAGLE report acceptance ~0.6-0.8 at k = 3-5 on chat data) and its draft is ~1/8 of the
target's bytes per step; here the draft is 2/32 layers plus the 2 x 1 GiB embedding and
head, ~1/5 of the target's bytes: the overhead side is pessimistic, the agreement side
optimistic; both are reported.

n-gram (prompt lookup) needs a target that copies; two bounds are measured: the "echo"
target (every layer's output projections zeroed, head tied to the embedding: it repeats
its last token, so every draft is accepted: the mechanism's best case at ``k``), and the
damped random target on a prompt that repeats itself (drafts found and rejected: what
speculating costs when it fails, with the per-sequence pause).

Reported per configuration and batch size (1 and 16): median time per output token over
``REPEATS`` runs (min and max beside it), acceptance rate and mean accepted length (from
the engine's counters over the timed runs), against no speculation on the same target.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DRAFT_LAYERS = 2
DEEP_SCALE = 0.02
K = 4
BATCHES = (1, 16)
REPEATS = 3
PROMPT_LEN, OUT_LEN = 128, 128


def write_draft_checkpoint(ckpt: Path, out: Path, layers: int = DRAFT_LAYERS) -> Path:
    """The first ``layers`` layers of ``ckpt`` with its embedding, norm, head and tokenizer."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json",) and f.is_file():
            if not f.name.startswith("model.safetensors.index"):
                shutil.copy(f, out / f.name)
    layer_prefixes = tuple(f"model.layers.{i}." for i in range(layers))
    keep = ("model.embed_tokens.", "model.norm.", "lm_head.", *layer_prefixes)
    tensors = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fh:
            for name in fh.keys():
                if name.startswith(keep):
                    tensors[name] = fh.get_tensor(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def damp_deep_layers(llm: Any, first: int = DRAFT_LAYERS, scale: float = DEEP_SCALE) -> None:
    """Scales the output projections of layers ``first..`` in place (CUDA graphs read the
    same memory)."""
    import torch

    with torch.no_grad():
        for layer in llm.engine.worker.model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def make_echo(llm: Any) -> None:
    """Zeroes every layer's output projections and ties the head to the embedding."""
    import torch

    model = llm.engine.worker.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)


def _prompts(batch: int, repeat: bool) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(batch)
    out = []
    for _ in range(batch):
        if repeat:  # a passage and its copy: prompt lookup finds the continuation
            half = torch.randint(3, 32000, (PROMPT_LEN // 2,), generator=g).tolist()
            out.append([1, *half, *half[: PROMPT_LEN // 2 - 1]])
        else:
            out.append([1, *torch.randint(3, 32000, (PROMPT_LEN - 1,), generator=g).tolist()])
    return out


def measure(llm: Any, batch: int, repeat: bool = False) -> dict[str, Any]:
    """Median TPOT of ``batch`` requests decoded together, over ``REPEATS`` runs, and the
    speculative counters of those runs."""
    from kvscale.server import SamplingParams

    eng = llm.engine
    prompts = _prompts(batch, repeat)
    sp = SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    before = eng.stats()
    spec = eng.core.speculator
    propose_before, wall = (spec.propose_s if spec else 0.0), 0.0
    tpots = []
    for _ in range(REPEATS):
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall += time.perf_counter() - t0
        per = [
            (o.metrics["finished_time"] - o.metrics["first_token_time"]) / (OUT_LEN - 1)
            for o in outs
        ]
        tpots.append(statistics.median(per))
    after = eng.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "tpot_ms": 1e3 * statistics.median(tpots),
        "tpot_ms_min": 1e3 * min(tpots),
        "tpot_ms_max": 1e3 * max(tpots),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "drafted_tokens": drafted,
        # the share of the runs' wall time spent in the proposer (host and its GPU work)
        "propose_share": ((spec.propose_s - propose_before) / wall) if spec else None,
    }


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sidecar(draft: Path, socket: Path, log: Path) -> subprocess.Popen[bytes]:
    socket.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "kvscale.cli", "serve-draft", "--model", str(draft),
        "--socket", str(socket), "--device", _device(), "--dtype", "bfloat16" if _device() ==
        "cuda" else "float32",
        "--max-num-seqs", "16", "--max-model-len", "2048", "--num-speculative-tokens", str(K),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ)
    deadline = time.monotonic() + 180
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the draft sidecar did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc


def _release_compiled() -> None:
    """Drops Dynamo's caches (compiled code holds the model) and frees the GPU memory."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measured(make_llm: Any, close: Any, prepare: Any, **kw: Any) -> dict[str, Any]:
    """An engine made with ``kw`` (k = ``K``), prepared, measured at ``BATCHES`` and freed
    before the next engine sizes its pool from the memory left; its error if it fails
    (the bench reports and goes on)."""
    try:
        llm = make_llm(num_speculative_tokens=K, **kw)
        prepare(llm)
        got = {f"b{b}": measure(llm, b) for b in BATCHES}
        close(llm)
        del llm
        _release_compiled()
        return got
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def phase_spec_piecewise(ckpt: Path, out_dir: Path, make_llm: Any, close: Any) -> dict[str, Any]:
    """The damped pair with verify steps replayed as piecewise CUDA graphs
    (``--cuda-graph-mode full_and_piecewise``; by default they run eagerly), against the
    target alone in the same mode."""
    draft = write_draft_checkpoint(ckpt, ckpt.parent / f"{ckpt.name}-draft{DRAFT_LAYERS}")
    pw = dict(
        cuda_graph_mode="full_and_piecewise",
        compile_cache_dir=str(out_dir / "compile-cache"),
        gpu_memory_utilization=0.75,
    )
    res: dict[str, Any] = {"k": K, "mode": "full_and_piecewise"}
    for name, kw in (
        ("none", {}),
        ("draft-inprocess", dict(speculative_method="draft", speculative_model=str(draft))),
    ):
        res[name] = _measured(make_llm, close, damp_deep_layers, **pw, **kw)
        print(f"[spec-piecewise] {name}: {res[name]}", flush=True)
    return res


def host_drafts(llm: Any) -> None:
    """The damped target with its in-process draft's drafts read on the host before each
    verify step (the path before ``Speculator.on_device``)."""
    damp_deep_layers(llm)
    llm.engine.core.speculator.on_device = False


def phase_spec_device(ckpt: Path, out_dir: Path, make_llm: Any, close: Any) -> dict[str, Any]:
    """The in-process draft pair with its drafts left on the GPU for the verify step (the
    default) against them read on the host first, at batch 1 and 16, each engine twice in
    alternation (``none`` first and last), on one machine."""
    draft = write_draft_checkpoint(ckpt, ckpt.parent / f"{ckpt.name}-draft{DRAFT_LAYERS}")
    pair = dict(speculative_method="draft", speculative_model=str(draft))
    order = [
        ("none", damp_deep_layers, {}),
        ("draft-inprocess", damp_deep_layers, pair),
        ("draft-inprocess-host", host_drafts, pair),
        ("draft-inprocess", damp_deep_layers, pair),
        ("draft-inprocess-host", host_drafts, pair),
        ("none", damp_deep_layers, {}),
    ]
    res: dict[str, Any] = {"k": K, "draft_layers": DRAFT_LAYERS, "deep_scale": DEEP_SCALE}
    for name, prepare, kw in order:
        got = _measured(make_llm, close, prepare, gpu_memory_utilization=0.75, **kw)
        res.setdefault(name, []).append(got)
        print(f"[spec-device] {name}: {got}", flush=True)
    return res


def phase_spec(ckpt: Path, out_dir: Path, make_llm: Any, close: Any) -> dict[str, Any]:
    """Every configuration at batch 1 and 16; ``make_llm(**kw)``/``close(llm)`` build and
    free an engine on the 8B-shaped checkpoint (engine_bench's)."""
    # beside the target, not in out_dir (results travel back; 3 GB of weights must not)
    draft = write_draft_checkpoint(ckpt, ckpt.parent / f"{ckpt.name}-draft{DRAFT_LAYERS}")
    res: dict[str, Any] = {"k": K, "draft_layers": DRAFT_LAYERS, "deep_scale": DEEP_SCALE}
    mem = dict(gpu_memory_utilization=0.75)  # room for a draft beside the target
    configs: dict[str, dict[str, Any]] = {
        "none": {},
        "draft-inprocess": dict(speculative_method="draft", speculative_model=str(draft)),
        "ngram": dict(speculative_method="ngram"),
    }

    def run(
        name: str, prepare: Any, repeat: bool, batches: tuple[int, ...] = BATCHES, **kw: Any
    ) -> None:
        """One configuration at ``batches`` (``kw`` over the engine's defaults); a failure
        is recorded and the others still run. The engine is freed on return."""
        got = res.setdefault(name, {})
        try:
            llm = make_llm(num_speculative_tokens=K, **{**mem, **kw})
            prepare(llm)
            for b in batches:
                got[f"b{b}"] = measure(llm, b, repeat=repeat)
            close(llm)
        except Exception as e:
            for b in batches:
                got.setdefault(f"b{b}", {"error": f"{type(e).__name__}: {e}"})
        print(f"[spec] {name} {batches}: {got}", flush=True)

    for name, kw in configs.items():
        run(name, damp_deep_layers, name == "ngram", **kw)
    sock = Path("/tmp/kvscale-draft-bench.sock")
    try:
        proc = _sidecar(draft, sock, out_dir / "draft-sidecar.log")
    except Exception as e:
        res["draft-sidecar"] = {"error": f"{type(e).__name__}: {e}"}
    else:
        try:
            run("draft-sidecar", damp_deep_layers, False, speculative_method="draft",
                speculative_model=f"unix://{sock}")  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    run("echo-none", make_echo, True)
    run("echo-ngram", make_echo, True, speculative_method="ngram")
    # n-gram proposals for 256 sequences at once (speculation forced on past its default
    # pause at 16): their share of a step, the verify step they precede included
    b256 = dict(batches=(256,), speculative_disable_by_batch_size=512, gpu_memory_utilization=0.92)
    run("echo-none", make_echo, True, **b256)
    run("echo-ngram", make_echo, True, speculative_method="ngram", **b256)
    return res


def spec_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per configuration and batch: TPOT against no speculation on the same target."""
    rows = []
    for name in ("draft-inprocess", "draft-sidecar", "ngram", "echo-ngram"):
        base = "echo-none" if name.startswith("echo") else "none"
        for b in (*BATCHES, 256):
            got, ref = res.get(name, {}).get(f"b{b}"), res.get(base, {}).get(f"b{b}")
            if not got or not ref or "error" in got or "error" in ref:
                continue
            rows.append(
                {
                    "config": name,
                    "batch": b,
                    "tpot_ms": got["tpot_ms"],
                    "base_tpot_ms": ref["tpot_ms"],
                    "ratio": got["tpot_ms"] / ref["tpot_ms"],
                    "acceptance_rate": got["acceptance_rate"],
                    "mean_accepted_length": got["mean_accepted_length"],
                    "propose_share": got.get("propose_share"),
                }
            )
    return rows


def format_spec_table(res: dict[str, Any]) -> str:
    rows = spec_rows(res)
    if not rows:
        return ""

    def f(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    lines = [
        "| configuration | batch | TPOT ms | without | ratio | acceptance | mean accepted length "
        "| time proposing |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['tpot_ms']:.2f} | {r['base_tpot_ms']:.2f} | "
            f"{r['ratio']:.2f}x | {f(r['acceptance_rate'], '.2f')} | "
            f"{f(r['mean_accepted_length'], '.2f')} | "
            f"{f(r['propose_share'] and 100 * r['propose_share'], '.1f')}% |"
        )
    return "\n".join(lines)
