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


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A copy of checkpoint ``src`` (same tokenizer) with Gaussian noise of ``scale``
    times each ``down_proj`` weight's std added: a draft that agrees with ``src`` often,
    not always (0.2 on the tiny demo model: about a third of greedy drafts accepted)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        w = load_file(f)
        for name, t in w.items():
            if name.endswith("down_proj.weight"):
                w[name] = t + scale * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)
        save_file(w, f, metadata={"format": "pt"})
    return dst
