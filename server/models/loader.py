"""Loads a local Hugging Face checkpoint (single or sharded safetensors) into a model.

Files are memory-mapped (``safe_open``) and every tensor reaches its parameter's
``weight_loader`` as a ``CheckpointTensor``: a handle that has not read anything yet.
The loaders narrow it to this rank's slice (``narrow``, in stored units: packed
dimensions included, as the parameters' ``output_dim``/``input_dim``/``packed_dim``
metadata says) and copy it in; only then are the slice's bytes read (``get_slice``).
So a rank of a tensor-parallel model reads its own shard of each tensor and nothing
else, whatever the format (dense, FP8, packed int4). Any other use of the handle (a
torch function, a tensor method) reads the (narrowed) tensor whole and proceeds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.models.registry import model_class
from kvscale.server.parallel import SINGLE, ParallelState
from kvscale.server.quantization import QuantizationConfig

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


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


def _unwrap(x: Any) -> Any:
    if isinstance(x, CheckpointTensor):
        return x.read()
    if isinstance(x, list | tuple):
        return type(x)(_unwrap(a) for a in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


class CheckpointTensor:
    """A tensor of a memory-mapped safetensors file, read lazily: ``narrow`` narrows
    what will be read; ``read()`` (or any torch function or tensor method) reads it.
    ``reads`` (shared, optional) collects the bytes read per tensor name."""

    def __init__(
        self,
        name: str,
        file_slice: Any,
        reads: dict[str, int] | None = None,
        ranges: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        self.name = name
        self._slice = file_slice
        self._reads = reads
        full = tuple(int(n) for n in file_slice.get_shape())
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in full)
        self.dtype: torch.dtype = _SAFETENSORS_DTYPES.get(file_slice.get_dtype(), torch.uint8)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self._ranges)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._ranges)

    @property
    def ndim(self) -> int:
        return len(self._ranges)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """The rows ``[start, start + length)`` of dimension ``dim``; nothing is read."""
        dim = dim % self.ndim
        lo, hi = self._ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise ValueError(
                f"tensor {self.name!r}: cannot take [{start}, {start + length}) of dimension "
                f"{dim} (size {hi - lo})"
            )
        ranges = list(self._ranges)
        ranges[dim] = (lo + start, lo + start + length)
        return CheckpointTensor(self.name, self._slice, self._reads, tuple(ranges))

    def read(self) -> torch.Tensor:
        """Reads this (narrowed) tensor from the file."""
        if not self._ranges:
            t = self._slice[...]
        else:
            t = self._slice[tuple(slice(a, b) for a, b in self._ranges)]
        if self._reads is not None:
            self._reads[self.name] = self._reads.get(self.name, 0) + t.numel() * t.element_size()
        return t

    def __getitem__(self, index: Any) -> Any:
        """Basic slices (``t[a:b]``, ``t[:, a:b]``) narrow without reading; any other
        index reads, then indexes."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) <= self.ndim and all(isinstance(i, slice) and i.step in (None, 1) for i in idx):
            out = self
            for dim, sl in enumerate(idx):
                start, stop, _ = sl.indices(out.shape[dim])
                out = out.narrow(dim, start, max(0, stop - start))
            return out
        return self.read()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape: Any) -> torch.Tensor:
        return self.read().reshape(*shape)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.read(), attr)  # any other tensor method: read, then apply

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return func(*_unwrap(args), **_unwrap(kwargs or {}))

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, {tuple(self.shape)}, {self.dtype})"


def _reading(op: str) -> Any:
    def apply(self: CheckpointTensor, *args: Any) -> Any:
        return getattr(self.read(), op)(*_unwrap(args))

    return apply


for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
            "__truediv__", "__neg__", "__float__", "__int__"):  # fmt: skip
    setattr(CheckpointTensor, _op, _reading(_op))


def iter_tensors(
    path: Path, reads: dict[str, int] | None = None
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint as a lazy ``CheckpointTensor`` (its file stays
    mapped while the caller handles it). ``reads``: bytes read per tensor, filled in."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, CheckpointTensor(name, f.get_slice(name), reads)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e


def load_model(
    cfg: ModelConfig,
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelState = SINGLE,
    quant: QuantizationConfig | None = None,
    reads: dict[str, int] | None = None,
) -> nn.Module:
    """Builds this rank's shard of the model for ``cfg`` on ``device`` in ``dtype`` and
    loads its weights (only this rank's slices are read; ``reads`` collects the bytes
    read per checkpoint tensor); linear layers get their method from ``quant`` (None:
    dense)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg)(cfg, parallel, quant)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iter_tensors(Path(path), reads))  # type: ignore[operator]
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()
