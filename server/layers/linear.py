"""Linear layers that shard across the tensor-parallel group (world size 1 for now).

Weights are ``[out_features_per_rank, in_features_per_rank]`` like ``nn.Linear``. Each
parameter carries a ``weight_loader(param, full_tensor, shard_id=None)`` that copies
this rank's slice of a full checkpoint tensor into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscale.server.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"tensor shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(_Linear):
    """The full weight on every rank."""


class ColumnParallelLinear(_Linear):
    """Splits the output dimension: rank r holds rows ``[r*n/tp, (r+1)*n/tp)``."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        self.tp = tp_size()
        super().__init__(in_features, _divide(out_features, self.tp, "out_features"), bias)
        self.gather_output = gather_output

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        size = param.data.shape[0]
        _copy_checked(param.data, loaded.narrow(0, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections).

    ``shard_id`` is the index of the output in ``output_sizes``.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        assert isinstance(shard_id, int)
        offset = sum(self.output_sizes[:shard_id]) // self.tp
        size = self.output_sizes[shard_id] // self.tp
        dst = param.data.narrow(0, offset, size)
        _copy_checked(dst, loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; heads are split across ranks (``shard_id`` q|k|v)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        # KV heads are replicated when there are fewer of them than ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (num_heads + 2 * self.num_kv_heads * tp) * head_dim
        super().__init__(hidden_size, out, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, tp_rank()
        elif shard_id == "k":
            offset, size, rank = q_size, kv_size, tp_rank() // self.kv_replicas
        elif shard_id == "v":
            offset, size, rank = q_size + kv_size, kv_size, tp_rank() // self.kv_replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        _copy_checked(dst, loaded.narrow(0, rank * size, size))


class RowParallelLinear(_Linear):
    """Splits the input dimension; partial outputs are summed over ranks, then bias added."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True
    ) -> None:
        super().__init__(_divide(in_features, tp_size(), "in_features"), out_features, bias)
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param.dim() == 1:  # bias: not sharded
            _copy_checked(param.data, loaded)
            return
        size = param.data.shape[1]
        _copy_checked(param.data, loaded.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
