"""Dense weights: ``weight [out, in]`` in the model dtype, multiplied by ``F.linear``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kvscale.server.quantization.base import LinearMethod, set_weight_attrs

# PyTorch's switches of the cuBLAS path, read when CUDA starts: where a user set one, their
# choice stands (with both workspaces at 0, cuBLASLt's calls failed: "OOM trying to
# allocate workspace for cublaslt", r74)
BLAS_ENV = ("TORCH_BLAS_PREFER_CUBLASLT", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
# Decode graphs of at most this many rows capture cuBLASLt's GEMM kernels; larger graphs
# and every eager or piecewise step keep cuBLAS's (H200s, NOTES e65/e66 measured, with
# cuBLASLt for every GEMM: C, one row, 1.0-1.3% faster; the decode step's kernels 2.9%
# faster at 64 rows and 2% slower at 256; B's eager mixed steps 4-13% slower)
CUBLASLT_MAX_ROWS = 64


def capture_with_cublaslt(device: torch.device, rows: int) -> bool:
    """Whether a CUDA graph of ``rows`` decode rows is captured with cuBLASLt's kernels:
    NVIDIA CUDA, ``rows <= CUBLASLT_MAX_ROWS``, and none of ``BLAS_ENV`` set."""
    return (
        device.type == "cuda"
        and not torch.version.hip
        and rows <= CUBLASLT_MAX_ROWS
        and not any(k in os.environ for k in BLAS_ENV)
    )


@contextmanager
def blas_for_capture(device: torch.device, rows: int) -> Iterator[None]:
    """Routes the CUDA GEMMs (``F.linear``) inside the block through cuBLASLt's heuristic
    where ``capture_with_cublaslt``, restoring the process's choice after: a graph keeps
    the kernels it captured, and every other step runs under the process's choice."""
    if not capture_with_cublaslt(device, rows):
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class DenseLinearMethod(LinearMethod):
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        layer.register_parameter("weight", set_weight_attrs(weight, output_dim=0, input_dim=1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
