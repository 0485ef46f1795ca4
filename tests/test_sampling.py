"""Sampling behaviour through the engine: seeds, batch invariance, stops, n>1, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from tests.hf_reference import random_prompts, token_in_text

PROMPTS = random_prompts(8, (4, 40), seed=7)


@pytest.fixture(scope="module")
def llm(llama_ckpt: Path) -> LLM:
    return LLM(str(llama_ckpt), device="cpu", max_num_batched_tokens=64, max_num_seqs=16)


def _tokens(llm: LLM, prompts: list, params: SamplingParams | list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_same_prompt_alone_and_in_mixed_batch(llm: LLM) -> None:
    target = PROMPTS[3]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    alone_greedy = _tokens(llm, [target], greedy)[0]
    alone_seeded = _tokens(llm, [target], seeded)[0]
    mixed = [*PROMPTS[:3], target, *PROMPTS[4:], target]
    others = SamplingParams(temperature=0.7, max_tokens=7, ignore_eos=True)
    params = [others] * 3 + [greedy] + [others] * 4 + [seeded]
    outs = _tokens(llm, mixed, params)
    assert outs[3] == alone_greedy
    assert outs[8] == alone_seeded


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm: LLM) -> None:
    def run(seed: int) -> list[list[int]]:
        p = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return _tokens(llm, PROMPTS[:4], p)

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_unseeded_sampling_uses_engine_seed(llama_ckpt: Path) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = _tokens(LLM(str(llama_ckpt), device="cpu", seed=5), PROMPTS[:3], p)
    b = _tokens(LLM(str(llama_ckpt), device="cpu", seed=5), PROMPTS[:3], p)
    assert a == b


def test_n_samples(llm: LLM) -> None:
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPTS[0], p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(PROMPTS[0], p)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_string_cuts_text(llm: LLM) -> None:
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = base[0].outputs[0].text
    assert len(text) > 12
    stop = text[8:12]
    cut = text.index(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    c = out[0].outputs[0]
    assert c.text == text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == base[0].outputs[0].token_ids[: len(c.token_ids)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = _tokens(llm, [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20))[0]
    stop_tok = base[4]
    first = base.index(stop_tok)
    out = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    )[0].outputs[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens bans the stop token for the first 6 tokens
    out = llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[stop_tok]),
    )[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert stop_tok not in out.token_ids[:6]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_tok


def test_max_tokens_and_max_model_len(llama_ckpt: Path) -> None:
    llm = LLM(str(llama_ckpt), device="cpu", max_model_len=32)
    out = llm.generate([1, 5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"
    out = llm.generate(
        [1, 5, 6, 7], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 28
    assert out[0].outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(checkpoint_factory: Callable[..., Path], llm: LLM) -> None:
    base = _tokens(
        llm, [PROMPTS[5]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    eos = base[3]
    # the same weights (same seed), with that token declared EOS
    path = checkpoint_factory("llama-eos", arch="llama", eos_token_id=eos)
    other = LLM(str(path), device="cpu")
    c = other.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert c.token_ids == base[: base.index(eos) + 1] and c.finish_reason == "stop"
    assert c.stop_reason is None
    c = other.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[
        0
    ].outputs[0]
    assert c.token_ids == base and c.finish_reason == "length"
    c = other.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=10, min_tokens=8))[
        0
    ].outputs[0]
    assert len(c.token_ids) >= 8 and eos not in c.token_ids[:8]


def test_logprobs_match_model_distribution(llm: LLM, llama_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[0]
    c = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + c.token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = lp[len(prompt) - 1 + i]
        assert entry[tok].rank == 1  # greedy picks the top token
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        assert [entry[t].rank for t in top] == [1, 2, 3]
        assert entry[tok].decoded_token == token_in_text(llm.get_tokenizer(), tok)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(n=0), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=50), "logprobs"),
        (dict(seed="x"), "seed"),
    ],
)
def test_invalid_sampling_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_repetition_penalty_matches_hand_computed(llm: LLM, llama_ckpt: Path) -> None:
    """First token with repetition_penalty = argmax of the penalized HF distribution."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)

    def last_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float()

    # Prompts that contain their own most likely next token, so the penalty must matter:
    # insert the top token before the last position until it stays the top token.
    prompts = []
    for p in PROMPTS:
        q = list(p)
        for _ in range(6):
            top = int(last_logits(q).argmax())
            if top in q:
                prompts.append(q)
                break
            q = [*q[:-1], top, q[-1]]
    assert len(prompts) >= 2
    penalty = 5.0
    for q in prompts:
        logits = last_logits(q)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[q] = True
        pen = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        expected = int(pen.argmax())
        assert expected != int(logits.argmax())
        got = _tokens(
            llm, [q], SamplingParams(temperature=0, max_tokens=1, repetition_penalty=penalty)
        )[0]
        assert got == [expected]


def test_frequency_and_presence_penalties_match_hand_computed(llm: LLM, llama_ckpt: Path) -> None:
    """Greedy with penalties on generated tokens = argmax of HF logits minus
    ``frequency * count + presence * [count > 0]`` at every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    prompt = [1] + [100] * 10  # a repetitive prompt: the random model then repeats itself
    plain = _tokens(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(set(plain)) < len(plain)
    freq, pres = 1.5, 0.5
    got = _tokens(
        llm,
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=8,
            ignore_eos=True,
            frequency_penalty=freq,
            presence_penalty=pres,
        ),
    )[0]
    expected: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=logits.shape[0])
        logits -= freq * counts + pres * (counts > 0).float()
        expected.append(int(logits.argmax()))
    assert got == expected
    assert got != plain
