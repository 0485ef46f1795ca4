"""Whether a draft model speaks the target's tokens: a fingerprint of a tokenizer.

Draft tokens are verified by id, so the draft's tokenizer must map every token to the
same id as the target's. ``tokenizer_fingerprint`` hashes the tokenizer's size and its
whole token -> id map (added and special tokens included), as loaded by
``kvscale.server.tokenizer.load_tokenizer``; equal fingerprints mean equal maps. Results
are cached per folder while its tokenizer files are unchanged (loading one takes ~1 s).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from kvscale.server.tokenizer import load_tokenizer

_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def _stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """The tokenizer files' sizes and modification times (the cache key)."""
    out = []
    for name in _FILES:
        f = folder / name
        if f.is_file():
            st = f.stat()
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


@lru_cache(maxsize=16)
def _load(folder: Path, stamp: tuple[tuple[str, int, int], ...]) -> tuple[str, int]:
    tokenizer = load_tokenizer(folder)
    vocab = tokenizer.get_vocab()  # token -> id, added tokens included
    h = hashlib.sha256()
    h.update(f"kvscale-tokenizer-v1 {len(tokenizer)}\n".encode())
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    return h.hexdigest(), len(tokenizer)


def _fingerprint_and_size(model_dir: str | Path) -> tuple[str, int]:
    folder = Path(model_dir).resolve()
    return _load(folder, _stamp(folder))


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """A sha256 hex digest of the tokenizer in ``model_dir`` (its size and token -> id map).
    CheckpointError (a ValueError) if it has no loadable tokenizer."""
    return _fingerprint_and_size(model_dir)[0]


def check_same_tokenizer(target_dir: str | Path, draft_dir: str | Path) -> str:
    """Returns the common fingerprint; ValueError naming both folders and both tokenizers'
    sizes if the draft's tokenizer maps any token to another id than the target's."""
    ft, nt = _fingerprint_and_size(target_dir)
    fd, nd = _fingerprint_and_size(draft_dir)
    if ft != fd:
        raise ValueError(
            f"the draft model's tokenizer differs from the target's: draft {str(draft_dir)!r} "
            f"(vocabulary of {nd} tokens, fingerprint {fd[:12]}) vs target {str(target_dir)!r} "
            f"({nt} tokens, fingerprint {ft[:12]}); speculative decoding needs a draft model "
            "with the same tokenizer"
        )
    return ft
