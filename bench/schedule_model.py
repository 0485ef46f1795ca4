"""An offline batch's steps under the engine's scheduler, and their time under a cost model.

NOTES e82 asks what ``max_num_seqs`` does to workload B (1,000 ShareGPT-like requests)
before a lease measures it. This replays the scheduler's policy on the request lengths
alone (``engine.scheduler``): first-come first-served admission up to ``max_num_seqs``
running sequences, and each step's token budget (``max_num_batched_tokens``) spent on the
running sequences in arrival order (a decode token each, or a prompt's next chunk), then
on new admissions (chunked prefill). Not modelled: preemption (B fits the KV pool) and the
one-deep pipeline's skipped step for a sequence whose last token is in flight. A
sequence's output tokens are counted from the step after its prompt is done, one a step,
and it ends after the last; counting a token at the step that finishes the prompt
instead gives 1,507 steps at 256 sequences, 399 with prefill.

Each step costs ``max(weights_s, tokens * token_s) + kv_tokens * kv_s + overhead_s``: the
weights' read or the step's matmuls, whichever is longer, then the decode rows' KV reads
(their contexts), then a fixed cost. ``StepCost.for_model`` derives the first three from a
config (``engine_bench``'s arithmetic: every bf16 weight but the embedding table read
once a step, 2 FLOP a matmul weight a token, the KV bytes a context token) and a GPU's measured copy
bandwidth and matmul rate; the command line's defaults are r88's H100 ceilings (3,000 GB/s,
760 TFLOP/s), with the matmuls at 78% of that rate (the 256-row GEMMs' 76-81%) and 0.6 ms
a step beside them.

    python bench/schedule_model.py [--max-num-seqs 256,512,1024] [--budget 8192]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_bench as eb  # bench/ is not a package


@dataclass(frozen=True)
class StepCost:
    """Seconds: a step's weights read, a token's matmuls, a context token's KV read, and
    a step's fixed cost."""

    weights_s: float
    token_s: float
    kv_s: float
    overhead_s: float

    @classmethod
    def for_model(
        cls,
        cfg: dict[str, Any],
        copy_bytes_per_s: float,
        flop_per_s: float,
        matmul_share: float = 0.78,
        overhead_s: float = 0.6e-3,
    ) -> StepCost:
        """A Llama-style ``cfg`` in bf16 on a GPU that copies ``copy_bytes_per_s`` and
        multiplies at ``flop_per_s`` (its matmul ceiling; steps reach ``matmul_share``)."""
        p = eb.param_counts(cfg)
        return cls(
            weights_s=eb.weight_bytes_per_step(cfg) / copy_bytes_per_s,
            token_s=2 * (p["linear"] + p["lm_head"]) / (matmul_share * flop_per_s),
            kv_s=eb.kv_bytes_per_token(cfg) / copy_bytes_per_s,
            overhead_s=overhead_s,
        )

    def __call__(self, tokens: int, kv_tokens: int) -> float:
        return max(self.weights_s, tokens * self.token_s) + kv_tokens * self.kv_s + self.overhead_s


@dataclass
class _Seq:
    prompt_left: int
    context: int
    output_left: int


def simulate(
    lengths: list[tuple[int, int]], max_num_seqs: int, budget: int, cost: StepCost
) -> dict[str, float]:
    """Runs ``(input, output)`` requests to completion; returns the seconds, the steps,
    the steps that prefill, and the output tokens/s."""
    waiting = list(lengths)
    running: list[_Seq] = []
    seconds, steps, mixed = 0.0, 0, 0
    while waiting or running:
        decoding: list[_Seq] = []
        left, prefill = budget, 0
        for s in running:  # in arrival order: a decode token, or the prompt's next chunk
            if left <= 0:
                break
            if s.prompt_left:
                n = min(s.prompt_left, left)
                s.prompt_left -= n
                s.context += n
                prefill += n
                left -= n
            else:
                decoding.append(s)
                left -= 1
        while waiting and len(running) < max_num_seqs and left > 0:
            prompt, out = waiting.pop(0)
            n = min(prompt, left)
            running.append(_Seq(prompt - n, n, out))
            left -= n
            prefill += n
        seconds += cost(len(decoding) + prefill, sum(s.context for s in decoding))
        steps += 1
        mixed += prefill > 0
        for s in decoding:
            s.context += 1
            s.output_left -= 1
        running = [s for s in running if s.prompt_left or s.output_left > 0]
    total_out = sum(o for _, o in lengths)
    return {
        "seconds": seconds,
        "steps": steps,
        "prefill_steps": mixed,
        "output_tok_per_s": total_out / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-num-seqs", default="256,512,1024")
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--copy-gbps", type=float, default=3000.0, help="GPU copy bandwidth, GB/s")
    ap.add_argument("--matmul-tflops", type=float, default=760.0, help="GPU bf16 matmul ceiling")
    args = ap.parse_args(argv)
    cost = StepCost.for_model(eb.LLAMA_31_8B, args.copy_gbps * 1e9, args.matmul_tflops * 1e12)
    lengths = eb.b_lengths()
    for s in (int(v) for v in args.max_num_seqs.split(",")):
        r = simulate(lengths, s, args.budget, cost)
        print(
            f"max_num_seqs {s:5d}: {r['steps']:5d} steps ({r['prefill_steps']} with prefill), "
            f"{r['seconds']:.1f} s, {r['output_tok_per_s']:,.0f} output tok/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
