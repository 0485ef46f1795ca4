"""xgrammar behind one small interface: compile a ``(kind, spec)`` key for a vocabulary,
make a matcher, fill token bitmasks.

A token bitmask is ``int32 [rows, ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32`` is
set when token ``t`` is allowed (xgrammar's layout). Compiled grammars are cached by
xgrammar's compiler (keyed by the spec), so a schema sent again compiles once.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from kvscale.server.structured.params import choice_ebnf, is_lark

CACHE_LIMIT_BYTES = 512 << 20  # compiled grammars kept (xgrammar's LRU cache)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary size (the model's, which may
    exceed the tokenizer's: the extra ids are never allowed). ``stop_token_ids``: what
    ends a finished grammar (the model's EOS ids). Thread-safe: compile from a pool."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=2, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self.no_control_chars = self._no_control_chars_mask()

    def _no_control_chars_mask(self) -> np.ndarray:
        """``int32 [W]``: every token except those whose bytes hold a control character
        (< 0x20). Compact JSON never contains one raw, but xgrammar 0.2.8 compiles a
        string with ``maxLength`` to ``[^"\\\r\n]{0,n}``, which lets them through; JSON
        masks are ANDed with this."""
        width = bitmask_width(self.vocab_size)
        bits = np.ones(width * 32, dtype=bool)
        for tid, piece in enumerate(self.info.decoded_vocab[: self.vocab_size]):
            if any(b < 0x20 for b in piece):
                bits[tid] = False
        bits[self.vocab_size :] = False
        words = (bits.reshape(width, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(1)
        return words.astype(np.uint32).view(np.int32)

    def compile(self, kind: str, spec: str) -> Any:
        """A compiled grammar (``xgrammar.CompiledGrammar``); raises on a bad spec."""
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(json.loads(spec)))
        if kind == "grammar":
            return (
                c.compile_grammar(self._xgr.Grammar.from_lark(spec))
                if is_lark(spec)
                else (c.compile_grammar(spec))
            )
        raise ValueError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the grammar's start."""
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], json_rows: list[bool] | None = None) -> np.ndarray:
        """``int32 [len(matchers), W]``: each matcher's allowed next tokens (rows marked
        in ``json_rows`` never allow a raw control character)."""
        import torch

        out = torch.empty((len(matchers), bitmask_width(self.vocab_size)), dtype=torch.int32)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(out, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, out)
        masks = out.numpy()
        if json_rows is not None and any(json_rows):
            masks[np.asarray(json_rows)] &= self.no_control_chars
        return masks
