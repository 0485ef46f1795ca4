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
(their contexts), then a fixed cost. The defaults are an H100's (8B bf16 weights at
~3 TB/s: 5.0 ms; 16 GFLOP a token at 78% of 760 TFLOP/s; 128 KiB of KV a token at
2.9 TB/s; 0.6 ms a step), and reproduce B's step counts at 256 sequences (1,512 steps, 402
of them with prefill, against r89's 1,511 and 402).

    python bench/schedule_model.py [--max-num-seqs 256,512,1024] [--budget 8192]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepCost:
    """Seconds: a step's weights read, a token's matmuls, a context token's KV read, and
    a step's fixed cost."""

    weights_s: float = 5.0e-3
    token_s: float = 21e-6 / 0.78
    kv_s: float = 131072 / 2.9e12
    overhead_s: float = 0.6e-3

    def __call__(self, tokens: int, kv_tokens: int) -> float:
        return max(self.weights_s, tokens * self.token_s) + kv_tokens * self.kv_s + self.overhead_s


@dataclass
class _Seq:
    prompt_left: int
    context: int
    output_left: int


def simulate(
    lengths: list[tuple[int, int]], max_num_seqs: int, budget: int, cost: StepCost = StepCost()
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
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import b_lengths  # bench/ is not a package

    lengths = b_lengths()
    for s in (int(v) for v in args.max_num_seqs.split(",")):
        r = simulate(lengths, s, args.budget)
        print(
            f"max_num_seqs {s:5d}: {r['steps']:5d} steps ({r['prefill_steps']} with prefill), "
            f"{r['seconds']:.1f} s, {r['output_tok_per_s']:,.0f} output tok/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
