"""Loads a local Hugging Face checkpoint (single or sharded safetensors) into a model.

Files are memory-mapped (``safe_open``); each tensor goes to its parameter's
``weight_loader``, which copies this rank's slice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.models.registry import model_class
from kvscale.server.parallel import SINGLE, ParallelState
from kvscale.server.quantization import QuantizationConfig


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, from the index file when there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists shard files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors weights in {str(path)!r} (.bin/.pt checkpoints are not supported)"
        )
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e


def load_model(
    cfg: ModelConfig,
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelState = SINGLE,
    quant: QuantizationConfig | None = None,
) -> nn.Module:
    """Builds this rank's shard of the model for ``cfg`` on ``device`` in ``dtype`` and
    loads its weights; linear layers get their method from ``quant`` (None: dense)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg)(cfg, parallel, quant)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iter_tensors(Path(path)))  # type: ignore[operator]
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()
