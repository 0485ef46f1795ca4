"""Linear layers sharded over the tensor-parallel group, each run by a linear method.

A layer knows its logical shape and how it is split across ranks; its ``LinearMethod``
(dense, or a quantized format) creates the parameters for this rank's shard and runs the
matmul. Every parameter carries ``weight_loader(param, full_tensor, shard_id=None)``,
which copies this rank's slice of a checkpoint tensor, and sharding metadata
(``output_dim``, ``input_dim``, ``packed_dim``/``pack_factor``, ``shard_scalar``: see
``quantization.base.set_weight_attrs``), so the loaders work for every method's tensors.
A merged layer (q/k/v, gate/up) lists its shards' widths in ``output_partition_sizes``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvscale.server.parallel import ParallelState
from kvscale.server.quantization import DenseLinearMethod, LinearMethod, set_weight_attrs
from kvscale.server.quantization.base import Fp8Activation


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"tensor shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
    dst.copy_(src)


def _stored(param: nn.Parameter, dim: int, logical: int) -> int:
    """``logical`` elements along ``dim`` of ``param`` in stored units (packing applied)."""
    if getattr(param, "packed_dim", None) == dim:
        return logical // param.pack_factor  # type: ignore[attr-defined]
    return logical


class LinearBase(nn.Module):
    """``x [T, in]`` -> ``[T, out]`` for this rank's ``[out_per_rank, in_per_rank]`` shard."""

    def __init__(
        self,
        in_per_rank: int,
        out_per_rank: int,
        bias: bool,
        parallel: ParallelState,
        method: LinearMethod | None,
        partitions: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_per_rank = in_per_rank
        self.out_per_rank = out_per_rank
        self.output_partition_sizes = partitions or [out_per_rank]  # this rank's shard widths
        self.linear_method = method or DenseLinearMethod()
        self.params_dtype = torch.get_default_dtype()  # the activations' dtype
        self.linear_method.create_weights(self, in_per_rank, out_per_rank, self.params_dtype)
        # the FP8 groups the method quantizes its input in: the layer before may do it
        self.fp8_input_group = self.linear_method.fp8_input_group(in_per_rank)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            b = nn.Parameter(torch.empty(out_per_rank), requires_grad=False)
            self.bias = set_weight_attrs(b, output_dim=0, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if getattr(param, "shard_scalar", False):
            _copy_checked(param.data[0], loaded.reshape(()))
            return
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelState,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, parallel, method)


class ColumnParallelLinear(LinearBase):
    """Splits the output dimension: rank r holds outputs ``[r*n/tp, (r+1)*n/tp)``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelState,
        method: LinearMethod | None = None,
        gather_output: bool = False,
        partitions: list[int] | None = None,
    ) -> None:
        out = parallel.shard(out_features, "out_features")
        super().__init__(in_features, out, bias, parallel, method, partitions)
        self.gather_output = gather_output

    def _load_rows(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        offset: int,
        size: int,
        rank: int,
        shard: int = 0,
    ) -> None:
        """Copies rows ``[rank*size, (rank+1)*size)`` of the checkpoint's output dimension
        into this shard's rows ``[offset, offset+size)`` (logical units); a per-shard
        scalar (``shard_scalar``) goes to entry ``shard``."""
        if getattr(param, "shard_scalar", False):
            _copy_checked(param.data[shard], loaded.reshape(()))
            return
        dim = getattr(param, "output_dim", None)
        if dim is None:  # not split (a per-tensor scale): every shard carries the same
            _copy_checked(param.data, loaded)
            return
        off, n = _stored(param, dim, offset), _stored(param, dim, size)
        _copy_checked(param.data.narrow(dim, off, n), loaded.narrow(dim, rank * n, n))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        self._load_rows(param, loaded, 0, self.out_per_rank, self.parallel.rank)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        y = self.linear_method.apply(self, x, self.bias)
        return self.parallel.all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections).

    ``shard_id`` is the index of the output in ``output_sizes``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        parallel: ParallelState,
        method: LinearMethod | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(
            in_features,
            sum(output_sizes),
            bias,
            parallel,
            method,
            partitions=[parallel.shard(s, "output size") for s in output_sizes],
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index of {self.output_sizes}, got {shard_id!r}")
        tp = self.parallel.world_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        self._load_rows(param, loaded, offset, size, self.parallel.rank, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; heads are split across ranks (``shard_id`` q|k|v)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        parallel: ParallelState,
        method: LinearMethod | None = None,
    ) -> None:
        tp = parallel.world_size
        self.head_dim = head_dim
        self.num_heads = parallel.shard(num_heads, "num_attention_heads")
        # KV heads are replicated when there are fewer of them than ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (num_heads + 2 * self.num_kv_heads * tp) * head_dim
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, out, bias, parallel, method, partitions=[q, kv, kv])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        rank = self.parallel.rank
        if shard_id == "q":
            self._load_rows(param, loaded, 0, q_size, rank, 0)
        elif shard_id == "k":
            self._load_rows(param, loaded, q_size, kv_size, rank // self.kv_replicas, 1)
        elif shard_id == "v":
            self._load_rows(param, loaded, q_size + kv_size, kv_size, rank // self.kv_replicas, 2)
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Splits the input dimension; partial outputs are summed over ranks, then bias added
    (once, after the sum)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        parallel: ParallelState,
        method: LinearMethod | None = None,
        reduce_results: bool = True,
    ) -> None:
        in_per_rank = parallel.shard(in_features, "in_features")
        super().__init__(in_per_rank, out_features, bias, parallel, method)
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if getattr(param, "shard_scalar", False):
            _copy_checked(param.data[0], loaded.reshape(()))
            return
        dim = getattr(param, "input_dim", None)
        if dim is None:  # bias, per-channel scales: not split
            _copy_checked(param.data, loaded)
            return
        size = param.data.shape[dim]  # stored units, packing or grouping included
        _copy_checked(param.data, loaded.narrow(dim, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        y = self.linear_method.apply(self, x, None)
        if self.reduce_results:
            y = self.parallel.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
