"""Llama-family decoder (Llama 2/3/3.1, Mistral without sliding window, Qwen2).

The three differ only in flags of ``ModelConfig``: q/k/v bias (Qwen2), tied
embeddings, rope scaling, GQA ratio. Input is the step's flattened tokens
(``input_ids [T] int64``, ``positions [T] int64``); output hidden states ``[T, H]``.
Every layer is built for one rank (``ParallelState``) and takes its linear method from
the checkpoint's quantization (``QuantizationConfig``, None: dense) by its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.layers.activation import SiluAndMul
from kvscale.server.layers.attention import Attention
from kvscale.server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvscale.server.layers.layernorm import RMSNorm
from kvscale.server.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvscale.server.layers.rotary import RotaryEmbedding
from kvscale.server.parallel import ParallelState
from kvscale.server.quantization import LinearMethod, QuantizationConfig
from kvscale.server.quantization.base import Fp8Activation


def _method(quant: QuantizationConfig | None, prefix: str) -> LinearMethod | None:
    return quant.linear_method(prefix) if quant is not None else None


def partial_sum(parallel: ParallelState, bias: bool) -> ParallelState | None:
    """Who sums a row-parallel layer's output: without a bias (added after the sum), the
    RMSNorm after it, fused with the residual add (returns the ranks to sum over); with
    one, the layer itself (None). None for one rank: nothing to sum."""
    return parallel if parallel.world_size > 1 and not bias else None


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelState,
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.qkv_bias,
            parallel,
            _method(quant, f"{prefix}.qkv_proj"),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim,
            cfg.hidden_size,
            cfg.o_bias,
            parallel,
            _method(quant, f"{prefix}.o_proj"),
            reduce_results=partial_sum(parallel, cfg.o_bias) is None,
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, cfg.head_dim, scale=cfg.head_dim**-0.5
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelState,
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [size, size],
            cfg.mlp_bias,
            parallel,
            _method(quant, f"{prefix}.gate_up_proj"),
        )
        self.down_proj = RowParallelLinear(
            size,
            cfg.hidden_size,
            cfg.mlp_bias,
            parallel,
            _method(quant, f"{prefix}.down_proj"),
            reduce_results=partial_sum(parallel, cfg.mlp_bias) is None,
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), self.down_proj.fp8_input_group))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelState,
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, parallel, quant, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(cfg, parallel, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the ranks that the attention's and the MLP's outputs are partial sums over
        self.attn_partial = partial_sum(parallel, cfg.o_bias)
        self.mlp_partial = partial_sum(parallel, cfg.mlp_bias)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the embeddings (``residual`` None) or the previous layer's MLP output;
        returns this layer's MLP output (a partial sum: ``mlp_partial``) and residual."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(
                x, residual, self.mlp_partial, self.self_attn.qkv_proj.fp8_input_group
            )
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(
            x, residual, self.attn_partial, self.mlp.gate_up_proj.fp8_input_group
        )
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, parallel: ParallelState, quant: QuantizationConfig | None
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, parallel, quant, f"model.layers.{i}")
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual, self.layers[-1].mlp_partial)
        return x


# an FP8-KV checkpoint's per-layer scales (llm-compressor: ``self_attn.k_scale``)
_KV_SCALE = re.compile(r"\.self_attn\.(k_scale|v_scale)$")

# checkpoint name fragment -> (our parameter fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelState,
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, parallel, quant)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [N, H]`` -> logits ``[N, vocab]`` in the model's dtype (the sampler
        upcasts them to fp32 when it needs more than their argmax: ``SamplingPlan.
        argmax_only``; a bf16 copy to fp32 was ~24 us of a 64-row decode step, r71), in
        ``out`` where given (``ParallelLMHead.compute_logits``)."""
        return self.lm_head.compute_logits(hidden, out)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) in; raises CheckpointError if any is missing."""
        params = dict(self.named_parameters(remove_duplicate=False))
        needed: set[tuple[str, object]] = set()
        for name in params:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            if name.endswith((".attn.k_scale", ".attn.v_scale")):
                continue  # only FP8-KV checkpoints have them
            if ".qkv_proj." in name:
                needed.update((name, s) for s in "qkv")
            elif ".gate_up_proj." in name:
                needed.update((name, s) for s in (0, 1))
            else:
                needed.add((name, None))
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard = _KV_SCALE.sub(r".self_attn.attn.\1", ckpt_name), None
            for frag, ours, shard_id in _STACKED:
                if frag in ckpt_name:
                    name, shard = ckpt_name.replace(frag, ours), shard_id
                    break
            param = params.get(name)
            if param is None:
                continue  # extra tensors (e.g. other heads) are ignored, like vLLM does
            try:
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor, shard)
            except ValueError as e:
                raise CheckpointError(f"tensor {ckpt_name!r}: {e}") from e
            needed.discard((name, shard))
        if needed:
            names = sorted({_hf_name(n, s) for n, s in needed})
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise CheckpointError(f"checkpoint is missing tensors: {shown}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded)


def _hf_name(name: str, shard: object) -> str:
    for frag, ours, shard_id in _STACKED:
        if ours in name and shard == shard_id:
            return name.replace(ours, frag)
    return name
