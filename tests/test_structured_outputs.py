"""Structured outputs, logit_bias and prompt logprobs through the engine (offline LLM) and
the sampler's device functions, on a random-weight checkpoint: the grammar, not the
model, makes the outputs valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.errors import InvalidRequestError
from kvscale.server.layers.sampler import apply_logit_bias, apply_token_bitmask
from kvscale.server.structured.params import StructuredOutputsParams as SO
from tests.hf_reference import random_prompts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
PROMPTS = random_prompts(8, (20, 90), seed=11)  # longer than a 64-token chunk


@pytest.fixture(scope="module")
def llm(llama_ckpt: Path) -> LLM:
    # 64-token steps: prompts are prefilled in chunks, constrained and free rows share steps
    return LLM(str(llama_ckpt), device="cpu", max_num_batched_tokens=64, max_num_seqs=16)


# ---- sampler functions ---------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [64, 77, 1000])
def test_token_bitmask_masks_exactly_the_disallowed_tokens(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([0, 3, 4])
    allowed = torch.rand(3, vocab, generator=gen) < 0.3
    width = (vocab + 31) // 32
    words = torch.zeros(3, width * 32, dtype=torch.int64)
    words[:, :vocab] = allowed.long()
    bitmask = (words.view(3, width, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        want[r][~allowed[i]] = float("-inf")
    got = apply_token_bitmask(logits.clone(), rows, bitmask)
    assert torch.equal(got, want)


def test_logit_bias_adds_to_the_named_tokens() -> None:
    logits = torch.zeros(2, 10)
    apply_logit_bias(
        logits, torch.tensor([0, 0, 1]), torch.tensor([3, 3, 9]), torch.tensor([1.5, 2.0, -100.0])
    )
    want = torch.zeros(2, 10)
    want[0, 3], want[1, 9] = 3.5, -100.0
    assert torch.equal(logits, want)


# ---- the engine ----------------------------------------------------------------------------
def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return True


def _params(kind: str, temperature: float, seed: int | None = None) -> SamplingParams:
    so = {
        "json": SO(json=PERSON),
        "regex": SO(regex=REGEX),
        "choice": SO(choice=CHOICES),
        "free": None,
    }[kind]
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=96 if so is not None else 12,
        ignore_eos=so is None,
        structured_outputs=so,
    )


def test_constrained_and_free_requests_share_steps(llm: LLM) -> None:
    kinds = ["json", "free", "regex", "json", "choice", "free", "json", "regex"]
    temps = [0.0, 0.0, 1.0, 1.0, 0.0, 0.8, 1.0, 0.0]
    params = [_params(k, t, seed=i) for i, (k, t) in enumerate(zip(kinds, temps, strict=True))]
    outs = llm.generate(PROMPTS, params)
    for kind, out in zip(kinds, outs, strict=True):
        c = out.outputs[0]
        if kind == "free":
            assert len(c.token_ids) == 12
        else:
            assert c.finish_reason == "stop", (kind, c.text)
            assert _valid(kind, c.text), (kind, c.text)
    # a free request's tokens do not depend on constrained neighbours, and a seeded
    # constrained request's output does not depend on its batch either
    for i in (1, 3):
        alone = llm.generate([PROMPTS[i]], [params[i]])[0].outputs[0]
        assert alone.token_ids == outs[i].outputs[0].token_ids


def test_json_object_and_grammar_kinds(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    quote, brace = tok.convert_tokens_to_ids('"'), tok.convert_tokens_to_ids("}")
    # random weights write endless strings; a bias on '"' and '}' keeps objects short
    bias = {quote: 6.0, brace: 6.0}
    ebnf = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]\n'
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,4}/\n'
    params = [
        SamplingParams(temperature=0, max_tokens=200, logit_bias=bias, structured_outputs=so)
        for so in (SO(json_object=True), SO(grammar=ebnf), SO(grammar=lark))
    ]
    params[1].max_tokens = 12  # digit+ may run on: a length finish is fine, the text is not
    outs = [o.outputs[0] for o in llm.generate(PROMPTS[:3], params)]
    assert isinstance(json.loads(outs[0].text), dict) and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"\(\d+\)", outs[1].text) or re.fullmatch(r"\(\d*", outs[1].text)
    assert re.fullmatch(r"<[a-z]{1,4}>", outs[2].text), outs[2].text


def test_grammar_ends_the_output_even_before_min_tokens(llm: LLM) -> None:
    p = SamplingParams(
        temperature=0, max_tokens=64, min_tokens=40, structured_outputs=SO(choice=CHOICES)
    )
    c = llm.generate(PROMPTS[:1], p)[0].outputs[0]
    assert c.text in CHOICES and c.finish_reason == "stop"


@pytest.mark.parametrize(
    ("so", "fragment"),
    [
        (SO(json={"type": "objec"}), 'Unsupported type "objec"'),
        (SO(regex="(abc"), "parenthesis"),
        (SO(grammar="root ::= foo"), 'Rule "foo" is not defined'),
    ],
)
def test_a_grammar_that_cannot_be_built_is_refused(llm: LLM, so: SO, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)) as e:
        llm.generate(["x"], SamplingParams(structured_outputs=so))
    assert e.value.param == "structured_outputs"


def test_structured_outputs_params_take_exactly_one_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SO(json={}, regex="a")
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        SO(choice=[])
    assert SO(json='{"type": "object"}').key == SO(json={"type": "object"}).key


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens(llm: LLM, temperature: float) -> None:
    forced = 1234
    outs = llm.generate(
        PROMPTS[:3],
        SamplingParams(
            temperature=temperature,
            seed=5,
            max_tokens=6,
            ignore_eos=True,
            logit_bias={forced: 100.0},
        ),
    )
    assert all(o.outputs[0].token_ids == [forced] * 6 for o in outs)
    free = llm.generate(
        PROMPTS[:3], SamplingParams(temperature=temperature, seed=5, max_tokens=6, ignore_eos=True)
    )
    banned = {t for o in free for t in o.outputs[0].token_ids}
    outs = llm.generate(
        PROMPTS[:3],
        SamplingParams(
            temperature=temperature,
            seed=5,
            max_tokens=6,
            ignore_eos=True,
            logit_bias=dict.fromkeys(banned, -100.0),
        ),
    )
    assert not banned & {t for o in outs for t in o.outputs[0].token_ids}
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(InvalidRequestError, match="vocab size"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))


def test_prompt_logprobs_equal_transformers_log_softmax(llm: LLM, llama_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = PROMPTS[:4]  # 20..90 tokens: prefilled over several 64-token steps
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1, n=2)
    outs = llm.generate(prompts, params)
    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        for j in range(1, len(prompt)):
            entry, row = plp[j], lp[j - 1]
            assert entry is not None
            tok = prompt[j]
            assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
            lo = int((row > row[tok] + 1e-4).sum()) + 1  # near ties may order either way
            hi = int((row > row[tok] - 1e-4).sum()) + 1
            assert lo <= entry[tok].rank <= hi
            top = row.topk(2).indices.tolist()
            assert set(top) <= set(entry)


def test_a_grammar_that_fails_to_compile_drops_only_its_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = llm.engine
    backend = eng.core.grammars._get_backend()
    real = backend.compile

    def compile_or_fail(kind: str, spec: str) -> object:
        if spec == "q+":
            raise RuntimeError("compiler exploded")
        return real(kind, spec)

    monkeypatch.setattr(backend, "compile", compile_or_fail)
    eng.add_request("bad", PROMPTS[0], SamplingParams(structured_outputs=SO(regex="q+")))
    eng.add_request("good", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.add_request("json", PROMPTS[2], _params("json", 0.0))
    finished, errors = {}, []
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        try:
            outs = eng.step()
        except InvalidRequestError as e:
            errors.append(str(e))
            continue
        finished.update({o.request_id: o for o in outs if o.finished})
    assert errors == ["request 'bad' was dropped: cannot compile the grammar: compiler exploded"]
    assert set(finished) == {"good", "json"}
    assert _valid("json", finished["json"].outputs[0].text)
    assert (
        not eng.core.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    )


def test_only_steps_with_constrained_rows_split_forward_and_sampling(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = llm.engine.worker
    calls = {"forward": 0, "launch": 0}
    real_forward, real_launch = worker.forward, worker.launch

    def forward(step):  # type: ignore[no-untyped-def]
        calls["forward"] += 1
        return real_forward(step)

    def launch(step):  # type: ignore[no-untyped-def]
        calls["launch"] += 1
        return real_launch(step)

    monkeypatch.setattr(worker, "forward", forward)
    monkeypatch.setattr(worker, "launch", launch)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # launch() runs forward() then sample(): free steps go through launch only, as before
    assert calls["launch"] > 0 and calls["forward"] == calls["launch"]
    calls.update(forward=0, launch=0)
    out = llm.generate(PROMPTS[:1], _params("choice", 0.0))[0].outputs[0]
    assert out.text in CHOICES
    # one split step per token, and at most one more: launched before the EOS was read
    assert len(out.token_ids) <= calls["forward"] - calls["launch"] <= len(out.token_ids) + 1
