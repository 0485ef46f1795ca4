"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from kvscale.server.config import ModelConfig
from kvscale.server.models.llama import LlamaForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return MODELS[cfg.architecture]
