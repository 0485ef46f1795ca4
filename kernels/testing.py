"""Helpers for the kernel tests and benchmarks: random paged caches and tolerances.

No Triton import here; safe to import anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscale.kernels._utils import is_interpreter

# Llama-3.1-8B's linear layers as (name, K, N) of ``y[M, N] = x[M, K] @ w[K, N]``: the
# shapes the kernel benchmarks and the native GPU tests run
LLAMA_8B_LINEARS = (
    ("qkv", 4096, (32 + 2 * 8) * 128),
    ("o", 32 * 128, 4096),
    ("gate_up", 4096, 2 * 14336),
    ("down", 14336, 4096),
)


def default_device() -> torch.device:
    """``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_native_gpu() -> bool:
    """CUDA is available and kernels are compiled (not the CPU interpreter)."""
    return torch.cuda.is_available() and not is_interpreter()


def kernel_dtypes() -> list[torch.dtype]:
    """fp32 and fp16 everywhere; bf16 only on a real GPU (the interpreter gets bf16 wrong)."""
    dtypes = [torch.float32, torch.float16]
    if on_native_gpu():
        dtypes.append(torch.bfloat16)
    return dtypes


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``atol``/``rtol`` for comparing a kernel with its fp32-math reference."""
    return {
        torch.float32: {"atol": 1e-4, "rtol": 1e-4},
        torch.float16: {"atol": 2e-3, "rtol": 1e-2},
        torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    }[dtype]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp32."""
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass
class PagedKV:
    """A random paged KV cache holding ``seq_lens`` tokens per sequence."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32


def random_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    spare_blocks: int = 3,
    pad_blocks: int = 1,
    garbage: float | None = float("nan"),
) -> PagedKV:
    """Random K/V for each sequence, stored in a shuffled set of blocks.

    Block ids are a random permutation, so tables are non-contiguous. ``spare_blocks`` unused
    blocks, the slots past each sequence's end and the ``pad_blocks`` padding columns of the
    table (pointing at spare blocks) hold ``garbage`` (NaN by default) so stray reads show;
    ``garbage=None`` leaves them random (faster for big benchmark caches).
    """
    device = torch.device(device)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + max(1, spare_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks)
    spare = perm[sum(need) :]
    width = max([*need, 1]) + pad_blocks
    table = torch.empty((len(seq_lens), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n].int()
        pad = spare[torch.randint(len(spare), (width - n,))]
        table[b, n:] = pad.int()
        start += n
    if garbage is not None:
        for cache in (k_cache, v_cache):
            cache[spare.to(device)] = garbage
            for b, n in enumerate(seq_lens):
                if n % block_size:
                    last = int(table[b, need[b] - 1])
                    cache[last, n % block_size :] = garbage
    return PagedKV(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
