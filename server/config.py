"""Engine settings, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvscale.server.model_config import ModelConfig, parse_dtype

VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_max_batch: int = 256  # largest decode batch replayed from a graph
    compile: bool = False  # torch.compile the non-attention parts (Inductor)
    # True: step() returns every request's state each step (servers stream it);
    # False: only finished requests, and text is detokenized once at the end.
    stream_outputs: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in VALID_BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {VALID_BLOCK_SIZES}, got {self.block_size}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def model_path(self) -> Path:
        return Path(self.model)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but no CUDA GPU is available")
        return torch.device(self.device)

    def torch_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        """ "auto": the checkpoint's dtype on GPU (fp32 checkpoints run in bf16 there);
        fp32 on CPU, where half-precision matmuls are slow or missing."""
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if model.dtype == torch.float32 else model.dtype

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if model.sliding_window is not None:
            # Sliding-window attention is not implemented: stay inside the window,
            # where full attention is the same computation.
            limit = min(limit, model.sliding_window)
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model allows ({limit}: "
                "max_position_embeddings, or the sliding window)"
            )
        return self.max_model_len
