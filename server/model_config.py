"""Reads a Hugging Face checkpoint's ``config.json`` into the fields the engine uses.

The file is read as JSON rather than through transformers' config classes so that
the engine behaves the same whichever transformers version is installed (v4 and v5
spell rope settings differently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """The path is not a usable checkpoint (missing files, unsupported model, bad tensors)."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Maps "float32"/"float16"/"bfloat16" (and aliases) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"dtype: {name} is not supported; use float32, float16 or bfloat16")
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(
            f"dtype: {name!r} is not supported; use 'auto', 'float32', 'float16' or 'bfloat16'"
        )
    return _DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a decoder-only checkpoint (Llama, Mistral, Qwen2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"kvscale supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # transformers v5 keeps rope settings in "rope_parameters"; v4 in rope_theta/rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type == "default":
                scaling = None
            elif rope_type not in ("llama3", "linear"):
                raise CheckpointError(
                    f"rope scaling type {rope_type!r} is not supported; "
                    "supported: none, 'linear', 'llama3'"
                )
            else:
                scaling = {**scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_bias=(not is_qwen2) and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            dtype=parse_dtype(dtype_name),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Reads ``PATH/config.json``; raises CheckpointError with the reason otherwise."""
        p = Path(path)
        if not p.is_dir():
            raise CheckpointError(f"model path {str(path)!r} is not a directory")
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(
                f"{str(path)!r} is not a Hugging Face checkpoint: config.json is missing"
            )
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(cfg)
        except KeyError as e:
            raise CheckpointError(f"{cfg_file} lacks the field {e.args[0]!r}") from e
