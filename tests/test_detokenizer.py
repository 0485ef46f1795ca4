"""Incremental detokenization: same text as a full decode, never a broken character."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.server.demo_model import write_tokenizer
from kvscale.server.engine.detokenizer import IncrementalDetokenizer, decoder, token_texts
from kvscale.server.tokenizer import load_tokenizer
from tests.hf_reference import token_in_text

TEXTS = [
    "Hello world, this is kvscale.",
    "café naïve 日本語のテキスト 🙂🦀 emoji ꙮ",
    "  leading spaces\nand\n\nnew lines\ttabs",
    "数学: ∑ x² = 𝔼[x]",
]


@pytest.fixture(scope="module")
def tok(llama_ckpt: Path):
    return load_tokenizer(llama_ckpt)


def _stream(tok, prompt_ids: list[int], out_ids: list[int]) -> tuple[str, list[str]]:
    d = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [d.update([t]) for t in out_ids]
    deltas.append(d.flush())
    return d.text, deltas


def _reference(tok, prompt_ids: list[int], out_ids: list[int]) -> str:
    full = tok.decode(prompt_ids + out_ids, skip_special_tokens=True)
    prefix = tok.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(prefix)
    return full[len(prefix) :]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text: str) -> None:
    prompt = tok.encode("Question:", add_special_tokens=True)
    out = tok.encode(text, add_special_tokens=False)
    streamed, deltas = _stream(tok, prompt, out)
    assert streamed == _reference(tok, prompt, out)
    assert all("\ufffd" not in d for d in deltas)
    # multi-byte characters arrive as several byte-fallback tokens: some deltas are empty
    if "🦀" in text:
        assert any(d == "" for d in deltas[:-1])


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_random_text_roundtrip(tok, text: str) -> None:
    prompt = tok.encode("x", add_special_tokens=True)
    out = tok.encode(text, add_special_tokens=False)
    streamed, deltas = _stream(tok, prompt, out)
    assert streamed == _reference(tok, prompt, out)
    assert "".join(deltas) == streamed


@pytest.mark.parametrize("kind", ["sentencepiece", "tekken"])
def test_token_texts_read_as_inside_running_text(kind: str, tmp_path: Path) -> None:
    """Logprobs' token strings: each token's text after another token, so "▁pound" keeps
    its space (SentencePiece's decoder strips it from a lone token) and byte-level pieces
    stay as they decode."""
    write_tokenizer(tmp_path, kind)
    t = load_tokenizer(tmp_path)
    decode = decoder(t)
    text = token_texts(t, decode)
    special = set(t.all_special_ids)
    checked = stripped = 0
    for i in range(3, len(t), 37):  # ~900 (sentencepiece) to ~3,500 (tekken) tokens
        ref = token_in_text(t, i)
        if i in special or "\ufffd" in ref:  # a byte of a character: no text alone
            continue
        assert text(i) == ref, (i, t.convert_ids_to_tokens(i), text(i), ref)
        checked += 1
        stripped += decode([i], False) != ref
    assert checked > 800
    # the SentencePiece vocabulary's word-initial pieces: a lone decode loses their space
    assert (stripped > checked // 4) if kind == "sentencepiece" else stripped == 0
    if kind == "sentencepiece":
        pp, spp = t.convert_tokens_to_ids(["pp", "\u2581pp"])
        assert (text(pp), text(spp)) == ("pp", " pp")  # two tokens, two strings
