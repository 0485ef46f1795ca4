"""Incremental detokenization that never emits a broken multi-byte character.

Each update decodes a short window of recent tokens twice (with and without the new
ones) and emits the difference, holding text back while the window ends in an
incomplete UTF-8 sequence (U+FFFD). The window starts inside the prompt so that
the first output token keeps its leading space, as it would in a full decode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens kept as left context for the first output tokens


def decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` for ``tokenizer``: straight to its Rust
    tokenizer when transformers would return the same text (no clean-up of spaces),
    skipping several microseconds of Python per call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


SENTENCEPIECE_SPACE = "\u2581"  # "▁": SentencePiece's mark of a space in a piece


def token_texts(tokenizer: Any, decode: Callable[[list[int], bool], str]) -> Callable[[int], str]:
    """``text(token_id)``: one token's text as it reads inside running text (logprobs'
    token strings). ``decode([id])`` alone drops the leading space a SentencePiece decoder
    strips from a text's first token ("▁pound" -> "pound"), so distinct tokens ("▁pp",
    "pp") would share a string and a sequence's strings would not join to its text; the
    spaces its piece starts with are put back (vLLM's fix, PR 48674). Byte-level pieces
    ("Ġpound") keep their space when decoded alone. Cached: at most one entry a token."""
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)

    @functools.cache
    def text(token_id: int) -> str:
        s = decode([token_id], False)
        piece = to_piece(token_id) if to_piece is not None else None
        if isinstance(piece, str) and piece.startswith(SENTENCEPIECE_SPACE):
            want = len(piece) - len(piece.lstrip(SENTENCEPIECE_SPACE))
            have = len(s) - len(s.lstrip(" "))
            s = " " * max(0, want - have) + s
        return s

    return text


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        decode: Callable[[list[int], bool], str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._decode_fn = decode or decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_fed = 0  # output tokens given to update() so far

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Appends tokens; returns the newly complete text (may be empty)."""
        self.ids.extend(new_token_ids)
        self.num_fed += len(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def finish(self, output_token_ids: list[int]) -> str:
        """At the end: feeds the output tokens not seen yet, then flushes."""
        delta = (
            self.update(output_token_ids[self.num_fed :])
            if len(output_token_ids) > self.num_fed
            else ""
        )
        return delta + self.flush()

    def flush(self) -> str:
        """At the end: whatever is still held back (e.g. a lone partial character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta
