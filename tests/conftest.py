"""Shared fixtures: small random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(name, **build_checkpoint_kwargs)`` -> path, built once per name."""
    from kvscale.server.demo_model import build_checkpoint

    cache: dict[str, Path] = {}

    def make(name: str, **kwargs: Any) -> Path:
        if name not in cache:
            cache[name] = build_checkpoint(tmp_path_factory.mktemp(name), **kwargs)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def llama_ckpt(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("llama", arch="llama")
