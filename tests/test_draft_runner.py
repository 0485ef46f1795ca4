"""The draft-model proposer in process: greedy drafts are the model's greedy tokens (also
after rollbacks and chunked catch-ups), the pool never leaks or overflows, sampled drafts
report their exact q, seeded drafts reproduce, and the tokenizer check."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.config import EngineConfig
from kvscale.server.spec_decode.draft_runner import (
    DRAFT_GRAPH_MAX_BATCH,
    DraftRunner,
    _DecodeRows,
    _Row,
    _Seq,
    draft_engine_config,
    draft_uniform,
)
from kvscale.server.spec_decode.proposer import DraftRequest
from kvscale.server.spec_decode.tokenizer_check import (
    check_same_tokenizer,
    tokenizer_fingerprint,
)
from kvscale.server.worker.step import as_decode_rows
from tests.draft_helpers import rows, swap_two_tokens

PROMPTS = [
    [1, 415, 2936, 9060, 285],
    [1, 22, 333, 4444],
    [1, *range(100, 140)],  # over two blocks of 16
    [1, 7, 8],
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Hundreds of tiny per-sequence attention ops: with several OpenMP threads they crawl
    on a busy 2-core CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def make_runner(llama_ckpt: Path) -> Callable[..., DraftRunner]:
    def make(k: int = 4, **settings: Any) -> DraftRunner:
        top_m = settings.pop("top_m", 8)
        cfg = draft_engine_config(str(llama_ckpt), device="cpu", **settings)
        return DraftRunner.from_engine_config(cfg, k, top_m=top_m)

    return make


@pytest.fixture(scope="module")
def greedy(llama_ckpt: Path) -> Callable[[list[list[int]], int], list[list[int]]]:
    """kvscale's own greedy decoding of the same checkpoint (the reference)."""
    llm = LLM(str(llama_ckpt), device="cpu", num_kv_blocks=128)

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    return run


def check_pool(r: DraftRunner) -> None:
    r.block_manager.check(r.tables())


def test_greedy_drafts_follow_greedy_decoding_across_rollbacks(
    make_runner: Callable[..., DraftRunner], greedy: Callable[..., list[list[int]]]
) -> None:
    runner = make_runner(k=4, num_kv_blocks=64)
    rng = random.Random(0)
    seqs = [list(p) for p in PROMPTS]
    ks = [4, 2, 3, 1]
    for step in range(4):
        reqs = [DraftRequest(i, s, k) for i, (s, k) in enumerate(zip(seqs, ks, strict=True))]
        got = runner.propose(reqs)
        check_pool(runner)
        assert got.q_ids is None and got.q_probs is None  # all greedy: point masses
        assert got.tokens.shape == (4, max(ks)) and got.tokens.dtype == np.int64
        ref = greedy(seqs, 4)
        assert rows(got) == [r[:k] for r, k in zip(ref, ks, strict=True)], step
        fresh = make_runner(k=4, num_kv_blocks=64)
        assert rows(fresh.propose(reqs)) == rows(got)  # rollback == recomputing from scratch
        # the "target" keeps some drafts, then a token the draft did not propose
        for i, s in enumerate(seqs):
            kept = rng.randrange(int(got.num_tokens[i]) + 1)
            other = (ref[i][kept] + 1 + rng.randrange(100)) % 32000
            seqs[i] = s + ref[i][:kept] + [other]
        ks = [rng.randrange(1, 5) for _ in seqs]
    assert runner.num_sequences == 4
    runner.release([0, 1])
    check_pool(runner)
    runner.release([2, 3, 99])  # an unknown id is ignored
    check_pool(runner)
    assert runner.num_sequences == 0
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks


def test_drafts_left_on_the_device_are_those_read_on_the_host(
    make_runner: Callable[..., DraftRunner],
) -> None:
    """``propose_on_device`` queues the same drafts (and q) as ``propose`` reads, says
    which row holds each request's, and records them as held at its next call."""
    host, device = make_runner(k=4, num_kv_blocks=64), make_runner(k=4, num_kv_blocks=64)
    rng = random.Random(1)
    seqs = [list(p) for p in PROMPTS]
    for step in range(4):
        temps = [0.0, 0.8, 0.0, 1.2] if step % 2 else [0.0] * 4
        reqs = [DraftRequest(i, s, 1 + (i + step) % 4, temps[i], 5 + i) for i, s in enumerate(seqs)]
        want = host.propose(reqs)
        got = device.propose_on_device(reqs)
        assert got.num_tokens.tolist() == want.num_tokens.tolist()
        assert (got.q_ids is None) == (want.q_ids is None) == (step % 2 == 0)
        for b, row in enumerate(got.rows.tolist()):
            d = int(got.num_tokens[b])
            assert got.tokens[row, :d].tolist() == want.tokens[b, :d].tolist(), (step, b)
            if want.q_ids is not None:
                assert got.q_ids[row, :d].tolist() == want.q_ids[b, :d].tolist()
                assert torch.equal(got.q_probs[row, :d], torch.from_numpy(want.q_probs[b, :d]))
        for i, s in enumerate(seqs):  # keep some drafts, then another token
            d = int(want.num_tokens[i])
            seqs[i] = s + want.tokens[i, : rng.randrange(d + 1)].tolist() + [rng.randrange(3, 999)]
    for i in range(len(seqs)):  # read back at the next call (here: the query)
        assert device.held_tokens(i) == host.held_tokens(i)
    check_pool(device)


def test_all_accepted_and_prefix_only_requests(
    make_runner: Callable[..., DraftRunner], greedy: Callable[..., list[list[int]]]
) -> None:
    runner = make_runner(k=3, num_kv_blocks=32)
    ref = greedy([PROMPTS[0]], 9)[0]
    first = runner.propose([DraftRequest(7, PROMPTS[0], 3)])
    assert rows(first) == [ref[:3]]
    assert runner.held_tokens(7) == PROMPTS[0] + ref[:3]
    # all three accepted plus a bonus token: only the last draft and the bonus are fed
    nxt = runner.propose([DraftRequest(7, PROMPTS[0] + ref[:4], 3)])
    assert rows(nxt) == [ref[4:7]]
    # a shorter request than what it holds (a prefix of it): recomputes the last token
    again = runner.propose([DraftRequest(7, PROMPTS[0] + ref[:2], 3)])
    assert rows(again) == [ref[2:5]]
    check_pool(runner)
    # k beyond the runner's max is clipped; the proposal keeps the requested width
    wide = runner.propose([DraftRequest(7, PROMPTS[0], 5)])
    assert wide.tokens.shape == (1, 5) and rows(wide) == [ref[:3]]


def test_chunked_catch_up_gives_the_same_drafts(
    make_runner: Callable[..., DraftRunner], greedy: Callable[..., list[list[int]]]
) -> None:
    # 16 tokens per forward: the 41-token prompt is fed over several chunks, and the
    # other prompts are split across chunk boundaries
    runner = make_runner(k=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=16)
    reqs = [DraftRequest(i, p, 4) for i, p in enumerate(PROMPTS)]
    assert rows(runner.propose(reqs)) == [r[:4] for r in greedy(PROMPTS, 4)]
    check_pool(runner)


def test_a_full_pool_drafts_fewer_and_frees_idle_sequences_first(
    make_runner: Callable[..., DraftRunner], greedy: Callable[..., list[list[int]]]
) -> None:
    # 6 blocks of 16 tokens; each 30-token sequence with k = 4 needs 33 tokens = 3 blocks
    runner = make_runner(k=4, num_kv_blocks=6, block_size=16)
    prompts = [[1, *range(200 + 40 * i, 229 + 40 * i)] for i in range(4)]
    ref = greedy(prompts, 4)
    got = runner.propose([DraftRequest(i, p, 4) for i, p in enumerate(prompts)])
    check_pool(runner)
    assert got.num_tokens.tolist() == [4, 4, 0, 0]
    assert rows(got)[:2] == [r[:4] for r in ref[:2]]
    assert got.tokens[2:].tolist() == [[-1] * 4] * 2
    # sequence 1 goes on (its own blocks suffice); then 2 needs 3 blocks: 0 idled longest
    assert rows(runner.propose([DraftRequest(1, prompts[1] + ref[1][:1], 4)])) == [
        greedy([prompts[1] + ref[1][:1]], 4)[0]
    ]
    got = runner.propose([DraftRequest(2, prompts[2], 4)])
    check_pool(runner)
    assert rows(got) == [ref[2][:4]]
    assert runner.held_tokens(0) is None and runner.held_tokens(1) is not None
    # 47 tokens: freeing sequence 1 leaves 3 blocks, 48 tokens: k = 2 fits, 4 does not
    short = [1, *range(500, 546)]
    got = runner.propose([DraftRequest(2, prompts[2], 4), DraftRequest(3, short, 4)])
    check_pool(runner)
    assert runner.held_tokens(1) is None
    assert got.num_tokens.tolist() == [4, 2]
    assert rows(got) == [ref[2][:4], greedy([short], 2)[0]]
    # a sequence longer than the whole pool: no drafts, no state, nobody freed for it
    huge = [1, *range(1000, 1200)]
    got = runner.propose([DraftRequest(9, huge, 4)])
    check_pool(runner)
    assert got.num_tokens.tolist() == [0] and runner.held_tokens(9) is None
    assert runner.held_tokens(2) is not None and runner.held_tokens(3) is not None


def test_bad_requests_draft_nothing(make_runner: Callable[..., DraftRunner]) -> None:
    runner = make_runner(k=2, num_kv_blocks=16, max_model_len=64)
    reqs = [
        DraftRequest(0, [], 2),  # nothing to continue
        DraftRequest(1, [1, 5, 32000], 2),  # outside the vocabulary
        DraftRequest(2, [1, 5, -3], 2),
        DraftRequest(3, [1] * 64, 2),  # a draft would pass max_model_len: one fits
        DraftRequest(4, [1] * 65, 2),  # already past it
        DraftRequest(5, [1, 5], 0),
    ]
    got = runner.propose(reqs)
    assert got.num_tokens.tolist() == [0, 0, 0, 1, 0, 0]
    check_pool(runner)
    assert runner.num_sequences == 1
    with pytest.raises(ValueError, match="twice"):
        runner.propose([DraftRequest(0, [1, 2], 1), DraftRequest(0, [1, 2], 1)])
    assert runner.propose([]).tokens.shape == (0, 0)


def _truncated_q(model: Any, prompt: list[int], temperature: float, m: int) -> dict[int, float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    vals, ids = (logits / temperature).topk(m)
    probs = torch.softmax(vals, -1)
    return dict(zip(ids.tolist(), probs.tolist(), strict=True))


def test_sampled_drafts_report_their_exact_q(
    make_runner: Callable[..., DraftRunner], llama_ckpt: Path
) -> None:
    from transformers import AutoModelForCausalLM

    runner = make_runner(k=3, num_kv_blocks=64, top_m=5)
    reqs = [
        DraftRequest(0, PROMPTS[0], 3, temperature=0.7, seed=11),
        DraftRequest(1, PROMPTS[1], 3),  # greedy, in a batch that samples
        DraftRequest(2, PROMPTS[2], 2, temperature=1.3),  # unseeded
        DraftRequest(3, PROMPTS[3], 3, temperature=1.0, seed=-5),
    ]
    got = runner.propose(reqs)
    check_pool(runner)
    assert got.q_ids is not None and got.q_probs is not None
    assert got.q_ids.shape == got.q_probs.shape == (4, 3, 5)
    assert got.q_ids.dtype == np.int32 and got.q_probs.dtype == np.float32
    for i, r in enumerate(reqs):
        for j in range(int(got.num_tokens[i])):
            ids, probs = got.q_ids[i, j].tolist(), got.q_probs[i, j]
            assert abs(float(probs.sum()) - 1) < 1e-5
            assert len(set(ids)) == len(ids)  # distinct: scatters into [V] never collide
            tok = int(got.tokens[i, j])
            assert tok in ids and probs[ids.index(tok)] > 0
            if r.temperature == 0:
                assert ids[0] == tok and probs.tolist() == [1, 0, 0, 0, 0]
    # q of draft 1 is the model's softmax(logits / T) over its top 5, renormalised
    hf = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32).eval()
    for i in (0, 2, 3):
        ref = _truncated_q(hf, list(reqs[i].token_ids), reqs[i].temperature, 5)
        q = dict(zip(got.q_ids[i, 0].tolist(), got.q_probs[i, 0].tolist(), strict=True))
        assert q.keys() == ref.keys()
        assert max(abs(q[t] - ref[t]) for t in q) < 1e-4
    # seeded rows reproduce on another runner, whatever their batch
    other = make_runner(k=3, num_kv_blocks=64, top_m=5)
    again = other.propose([reqs[3], DraftRequest(9, PROMPTS[2], 3, 0.9), reqs[0]])
    for a, b in ((0, 2), (3, 0)):
        assert got.tokens[a].tolist() == again.tokens[b].tolist()
        assert np.array_equal(got.q_ids[a], again.q_ids[b])
        assert np.allclose(got.q_probs[a], again.q_probs[b], atol=1e-6)


def test_seeded_first_drafts_follow_q(make_runner: Callable[..., DraftRunner]) -> None:
    n, m = 600, 4
    runner = make_runner(k=1, num_kv_blocks=n, top_m=m, max_num_seqs=n)
    reqs = [DraftRequest(i, PROMPTS[1], 1, temperature=2.0, seed=1000 + i) for i in range(n)]
    got = runner.propose(reqs)
    assert got.q_ids is not None and got.q_probs is not None
    q = dict(zip(got.q_ids[0, 0].tolist(), got.q_probs[0, 0].tolist(), strict=True))
    assert all(np.array_equal(got.q_ids[i, 0], got.q_ids[0, 0]) for i in range(n))
    assert min(q.values()) > 0.05  # a flat enough q for the test to see every token
    counts = dict.fromkeys(q, 0)
    for t in got.tokens[:, 0].tolist():
        counts[t] += 1
    tv = 0.5 * sum(abs(counts[t] / n - q[t]) for t in q)
    assert tv < 0.1, (counts, q)  # ~0.035 expected at n = 600; always-argmax gives > 0.4
    assert draft_uniform(3, 10, 0) == draft_uniform(3, 10, 0) != draft_uniform(3, 11, 0)
    assert 0 <= draft_uniform(-1, 0, 5) < 1


def test_from_model_path_checks_the_tokenizer(llama_ckpt: Path, tmp_path: Path) -> None:
    target, _ = EngineConfig(model=str(llama_ckpt), device="cpu", max_model_len=256).load()
    runner = DraftRunner.from_model_path(str(llama_ckpt), target, k=2, kv_cache_tokens=512)
    eng = runner.config.engine
    assert eng.cuda_graph_mode == "full_decode_only" and not eng.enable_prefix_caching
    assert eng.cuda_graph_max_batch == DRAFT_GRAPH_MAX_BATCH
    assert runner.block_manager.num_blocks == 32 and runner.max_model_len == 256
    assert runner.vocab_size == 32000 and runner.name == "draft"
    other = swap_two_tokens(llama_ckpt, tmp_path / "other")
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(llama_ckpt)
    assert check_same_tokenizer(llama_ckpt, llama_ckpt) == tokenizer_fingerprint(llama_ckpt)
    with pytest.raises(ValueError, match="tokenizer differs") as e:
        DraftRunner.from_model_path(str(other), target, k=2)
    assert str(other) in str(e.value) and str(llama_ckpt) in str(e.value)


def test_held_prefix_len_trusts_accepted_tokens_and_checks_replacement() -> None:
    from kvscale.server.spec_decode.prefix import common_prefix_len, held_prefix_len

    held = [1, 2, 3, 4, 9, 9]  # 4 accepted tokens sent before, then 2 drafts
    assert held_prefix_len(held, [1, 2, 3, 4, 9, 7, 5], 4) == 5  # one draft accepted
    assert held_prefix_len(held, [1, 2, 3, 4, 8], 4) == 4  # none
    assert held_prefix_len(held, [1, 2, 3, 4, 9, 9, 6], 4) == 6  # both
    # a replaced sequence (its last sent token differs) is compared in full
    assert held_prefix_len(held, [1, 2, 7, 5, 9], 4) == 2
    assert held_prefix_len(held, [1, 2], 4) == 2
    assert held_prefix_len([], [1, 2], 0) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2


def test_decode_step_arrays_match_a_row_by_row_layout() -> None:
    """The one-token decode steps' inputs, built once a call as arrays (``_DecodeRows``),
    equal a row-by-row construction, for rows of different lengths, tables and
    temperatures, and padding them to a graph's rows leaves the cached tables alone."""
    rng = np.random.default_rng(0)
    bs = 16
    rows = []
    for i in range(7):
        n = int(rng.integers(1, 90))
        table = rng.permutation(200)[: -(-(n + 4) // bs)].tolist()
        seq = _Seq([], n, table, n - 1, 0)
        rows.append(_Row(i, seq, n, 4, [0.0, 0.7][i % 2], None))
    active = (0, 2, 3, 6)
    dec = _DecodeRows.of(rows, active)
    for j in (1, 2, 3):
        got = dec.arrays(j, bs)
        pos = [rows[i].n + j - 1 for i in active]
        width = max(len(rows[i].seq.table) for i in active)
        want = {
            "ids": [-(i + 1) for i in active],
            "positions": pos,
            "slots": [
                rows[i].seq.table[p // bs] * bs + p % bs for i, p in zip(active, pos, strict=True)
            ],
            "seq_lens": [p + 1 for p in pos],
            "q_start": list(range(len(active) + 1)),
            "tables": [rows[i].seq.table + [0] * (width - len(rows[i].seq.table)) for i in active],
            "logits_idx": list(range(len(active))),
            "draft_rows": list(active),
        }
        assert got.keys() == want.keys()
        for name, values in want.items():
            assert np.allclose(got[name], np.array(values)), (name, j)
            assert got[name].shape == np.array(values).shape, (name, j)
        dtypes = {k: v.dtype.name for k, v in got.items()}
        assert dtypes == {
            "ids": "int64", "positions": "int64", "slots": "int64", "seq_lens": "int32",
            "q_start": "int32", "tables": "int32", "logits_idx": "int64", "draft_rows": "int64",
        }  # fmt: skip
    assert dec.temp.tolist() == pytest.approx([rows[i].temperature or 1.0 for i in active])
    assert dec.greedy.tolist() == [rows[i].temperature == 0 for i in active]
    tables = dec.tables.copy()
    padded = dec.arrays(1, bs)
    assert as_decode_rows(padded, len(active), 8) == len(active)
    assert (
        padded["tables"].shape == (8, tables.shape[1]) and padded["slots"][4:].tolist() == [-1] * 4
    )
    assert np.array_equal(dec.tables, tables)


def test_the_host_time_script_runs_the_runner() -> None:
    """bench/profile_draft_runner.py on the CPU: one line a batch, its three medians."""
    import re
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "profile_draft_runner.py"
    out = subprocess.run(
        [sys.executable, str(script), "--batch", "1,3", "--calls", "36"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"},
    ).stdout  # fmt: skip
    lines = re.findall(
        r"batch (\d+), k=4: propose -> first forward (\d+) us; last forward -> return (\d+) us;"
        r" a decode step's host work before its forward (\d+) us \(medians of 6 calls\)",
        out,
    )
    assert [line[0] for line in lines] == ["1", "3"], out
    assert all(int(v) > 0 for line in lines for v in line[1:])
