"""Helpers of the draft-model proposer tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvscale.server.spec_decode.proposer import Proposal


def rows(p: Proposal) -> list[list[int]]:
    """Each request's drafted tokens."""
    return [p.tokens[i, : int(p.num_tokens[i])].tolist() for i in range(len(p.num_tokens))]


def swap_two_tokens(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` whose tokenizer maps two ordinary tokens (ids 1000 and
    1001) the other way round: another tokenizer of the same size."""
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    a, b = by_id[1000], by_id[1001]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return dst
