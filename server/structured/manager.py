"""The engine's grammar state: compiles requests' grammars off the step loop, keeps one
matcher per constrained sequence and fills the step's token bitmasks.

Compilation runs on one background thread (xgrammar releases the GIL while it works):
``submit`` returns at once, the engine core holds the request back from scheduling
until ``poll`` finds its grammar compiled (or failed: the request is refused with the
reason). The first constrained request also pays for importing xgrammar and building
the vocabulary's token table (about a second, on that thread); free requests never do.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvscale.server.structured.backend import GrammarBackend
from kvscale.server.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

JSON_KINDS = ("json", "json_object")


class GrammarManager:
    """``tokenizer_path``: where the engine's tokenizer is (loaded on first use, in the
    compile thread); ``vocab_size``: the model's; ``stop_token_ids``: its EOS ids."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._pool: ThreadPoolExecutor | None = None

    def _get_backend(self) -> GrammarBackend:
        if self._backend is None:
            from kvscale.server.tokenizer import load_tokenizer

            tok = load_tokenizer(self.tokenizer_path)
            self._backend = GrammarBackend(tok, self.vocab_size, self.stop_token_ids)
        return self._backend

    def submit(self, params: StructuredOutputsParams) -> Future[Any]:
        """Starts compiling; the future's result is the compiled grammar."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvscale-grammar")
        kind, spec = params.key
        return self._pool.submit(lambda: self._get_backend().compile(kind, spec))

    def matcher(self, compiled: Any) -> Any:
        assert self._backend is not None
        return self._backend.matcher(compiled)

    def fill(
        self, matchers: list[Any], bans: list[list[int] | None], kinds: list[str]
    ) -> np.ndarray:
        """``int32 [R, W]`` bitmasks of ``matchers`` (None: a finished row, all allowed);
        ``kinds[i]``: row i's ``StructuredOutputsParams.kind``.
        ``bans[i]``: tokens row i may not take now (EOS before ``min_tokens``), cleared
        from its mask unless that would leave it nothing (then the grammar wins: it can
        only end)."""
        assert self._backend is not None
        live = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        out = np.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        if live:
            json_rows = [kinds[i] in JSON_KINDS for i in live]
            out[live] = self._backend.fill([matchers[i] for i in live], json_rows)
        live_set = set(live)
        for i, ban in enumerate(bans):
            if not ban or i not in live_set:
                continue
            row = out[i].view(np.uint32).copy()
            for t in ban:
                if 0 <= t < self.vocab_size:
                    row[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            if row.any():
                out[i] = row.view(np.int32)
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
