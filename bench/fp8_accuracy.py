"""FP8 accuracy against the full-precision model: KL divergence and top-1 agreement of the
next-token distributions, teacher-forced over natural text.

Variants (each loaded through the engine's real loader, one at a time): FP8 weights
(``quantization="fp8"``, quantized at load) and FP8 weights + FP8 KV cache, against the
checkpoint in ``--dtype`` (bf16 on the GPU). Text: this repository's own Markdown files
(English prose with some code), tokenized with the checkpoint's tokenizer and cut into
``--seq-len``-token sequences until ``--tokens`` positions are covered; each sequence is
one prefill whose every position's logits are kept (the KV cache is written and read
back inside the prefill, so an FP8 cache's rounding is part of the result).

    python bench/fp8_accuracy.py --model CKPT --out bench/results/fp8_accuracy.json

Metrics per variant, over all positions: mean KL(P_ref || P_variant) in nats, top-1
agreement (argmax equal), and each model's mean negative log-likelihood of the text's
next tokens.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, dict[str, str]] = {
    "fp8_weights": {"quantization": "fp8"},
    "fp8_weights_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def text_corpus(root: Path = ROOT) -> str:
    """The repository's Markdown files, in a fixed order."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "bench/NOTES.md"]
    return "\n\n".join(f.read_text() for f in files if f.is_file())


def sequences(ids: list[int], seq_len: int, num_tokens: int) -> list[list[int]]:
    """Consecutive ``seq_len``-token windows of ``ids`` covering ``num_tokens`` positions
    (the last may be shorter); the text repeats if it is too short."""
    if not ids:
        raise ValueError("no text to evaluate on")
    while len(ids) < num_tokens:
        ids = ids + ids
    ids = ids[:num_tokens]
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]


def kl_and_top1(ref_lp: torch.Tensor, lp: torch.Tensor) -> tuple[float, int]:
    """Summed KL(ref || q) over rows and the count of rows whose argmax agrees
    (``[N, V]`` log-probabilities)."""
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(dim=-1).clamp_min(0).sum()
    return float(kl), int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())


def next_token_nll(lp: torch.Tensor, ids: list[int]) -> float:
    """Summed negative log-likelihood of ``ids[1:]`` under rows ``lp[:-1]``."""
    target = torch.tensor(ids[1:], device=lp.device)
    return float(-lp[:-1].gather(1, target[:, None]).sum())


def _worker(model: str, device: str, dtype: str, seq_len: int, **settings: str) -> Any:
    from kvscale.server.config import EngineConfig
    from kvscale.server.worker.worker import Worker

    cfg = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        max_model_len=seq_len,
        max_num_seqs=1,
        max_num_batched_tokens=seq_len,
        num_kv_blocks=-(-seq_len // 16) + 1,
        enforce_eager=True,
        enable_prefix_caching=False,
        **settings,
    )
    resolved, tokenizer = cfg.load()
    return Worker(resolved), tokenizer


@torch.inference_mode()
def position_logprobs(worker: Any, seq: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(seq), V]`` (fp32) of every position of one prefill."""
    from kvscale.server.worker.host_to_device import to_device
    from kvscale.server.worker.step import profile_step

    step = profile_step(len(seq), worker.block_size)
    step.arrays["ids"] = np.asarray(seq, dtype=np.int64)
    step.arrays["logits_idx"] = np.arange(len(seq), dtype=np.int64)
    logits = worker._forward_eager(step, to_device(step.arrays, worker.device))
    return torch.log_softmax(logits.float(), dim=-1)


def evaluate(model: str, device: str, dtype: str, num_tokens: int, seq_len: int) -> dict[str, Any]:
    worker, tokenizer = _worker(model, device, dtype, seq_len)
    # the tokenizer may know more ids than the model's vocabulary (the 8B-shaped checkpoint
    # carries the 131k Tekken tokenizer over 128,256 rows): keep the ids the model has
    ids = [
        i
        for i in tokenizer.encode(text_corpus(), add_special_tokens=False)
        if i < worker.vocab_size
    ]
    seqs = sequences(ids, seq_len, num_tokens)
    refs = [position_logprobs(worker, s).cpu() for s in seqs]
    positions = sum(len(s) for s in seqs)
    out: dict[str, Any] = {
        "reference": {"dtype": dtype, "nll": sum(map(next_token_nll, refs, seqs)) / positions},
    }
    del worker
    for name, settings in VARIANTS.items():
        worker, _ = _worker(model, device, dtype, seq_len, **settings)
        kl = nll = 0.0
        agree = 0
        for ref, seq in zip(refs, seqs, strict=True):
            lp = position_logprobs(worker, seq)
            k, a = kl_and_top1(ref.to(lp.device), lp)
            kl, agree, nll = kl + k, agree + a, nll + next_token_nll(lp, seq)
        out[name] = {
            "settings": settings,
            "mean_kl_nats": kl / positions,
            "top1_agreement": agree / positions,
            "nll": nll / positions,
            "kv_cache_dtype": str(worker.kv_pool.dtype),
        }
        del worker
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["meta"] = {
        "positions": positions,
        "sequences": len(seqs),
        "seq_len": seq_len,
        "model": model,
        "device": device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (bf16/fp16/fp32)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the reference's (and variants') dtype")
    ap.add_argument("--tokens", type=int, default=4096, help="positions evaluated")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    res = evaluate(args.model, args.device, args.dtype, args.tokens, args.seq_len)
    text = json.dumps(res, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    for name in VARIANTS:
        r = res[name]
        print(
            f"{name}: mean KL {r['mean_kl_nats']:.4f} nats, top-1 agreement "
            f"{100 * r['top1_agreement']:.1f}% over {res['meta']['positions']} positions",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
