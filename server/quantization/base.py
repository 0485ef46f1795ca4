"""The interfaces every quantization format implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch
from torch import nn


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> nn.Parameter:
    """Attaches sharding metadata to a parameter; returns it.

    ``output_dim`` / ``input_dim``: which dimension of the tensor (as stored in the
    checkpoint and here) holds the layer's output / input features, or absent when the
    tensor is not split along it (a per-tensor scale, a bias of a row-parallel layer).
    ``packed_dim`` and ``pack_factor``: that dimension stores ``pack_factor`` logical
    elements per stored element (int4 packed in int32: 8). ``weight_loader``: the layer's
    function that copies this rank's slice of a checkpoint tensor in.
    """
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


class Fp8Activation(NamedTuple):
    """An activation quantized to FP8 by the kernel that made it (a norm or SiLU-and-mul),
    for a linear method that would quantize it so itself (``fp8_input_group``):
    ``codes [T, K]`` float8_e4m3fn, ``scales [T, K / group]`` fp32, and the 16-bit
    ``dtype`` it was made in (the layer's output dtype)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


class LinearMethod(ABC):
    """Creates a linear layer's parameters and runs its matmul."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        """Registers the layer's weight parameters for this rank's ``[out, in]`` shard
        (feature counts are logical, before any packing), with ``set_weight_attrs``."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in]`` -> ``[T, out]`` in ``x``'s dtype (an ``Fp8Activation``'s
        ``dtype`` where ``fp8_input_group`` takes one)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Repacks loaded weights for the kernels (optional)."""

    def fp8_input_group(self, in_features: int) -> int | None:
        """The group of input columns this method quantizes its input to FP8 in, token
        by token and on the fly, if it does: ``apply`` then also takes an
        ``Fp8Activation`` quantized so. None: 16-bit input only."""
        return None


class QuantizationConfig(ABC):
    """A checkpoint's quantization: picks each layer's linear method."""

    name: str

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer named ``prefix`` (e.g. ``model.layers.0.mlp
        .down_proj``); layers a checkpoint leaves unquantized get ``DenseLinearMethod``."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name
