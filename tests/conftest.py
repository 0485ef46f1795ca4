"""Shared fixtures: small random-weight checkpoints built once per test session."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's default cache (/tmp/torchinductor_$USER) is shared by every torch on the
# machine, and C++ kernels built against another torch's headers fail to compile ("at::vec
# has not been declared": a precompiled header of another, or a removed, environment):
# one cache per torch version and environment.
_ENV = hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"torchinductor-kvscale-{version('torch')}-{_ENV}"),
)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo() -> Iterator[None]:
    """Each test module starts with Dynamo's caches empty, as a new server process does:
    engines built by earlier modules share the model's forward code object, and Dynamo
    stops compiling a code object after ``recompile_limit`` different backends."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


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


def echo_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` with every layer's output projections zeroed and the head tied to the
    embedding: the residual stream is the token's embedding, so greedy decoding repeats
    the last token (a model whose output n-gram lookup predicts exactly)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        w = load_file(f)
        for name in w:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w[name] = torch.zeros_like(w[name])
        if "lm_head.weight" in w:
            w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
        save_file(w, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def echo_ckpt(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return echo_checkpoint(llama_ckpt, tmp_path_factory.mktemp("echo") / "ckpt")
