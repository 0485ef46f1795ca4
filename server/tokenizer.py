"""Loads a checkpoint's tokenizer (tokenizer.json + tokenizer_config.json, chat template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscale.server.config import CheckpointError


def load_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer; CheckpointError if the files are missing or bad."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer.model").is_file():
        raise CheckpointError(f"no tokenizer in {str(path)!r}: tokenizer.json is missing")
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: {e}") from e
