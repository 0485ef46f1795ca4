"""A checkpoint's module names, and which of its linear layers a format leaves dense.

kvscale fuses q/k/v and gate/up into one layer each; a format's skip list names the
checkpoint's own modules, so a fused layer is dense only if the list skips all of its
parts (skipping some of them is refused: one layer cannot be half quantized).
"""

from __future__ import annotations

from collections.abc import Callable

from kvscale.server.config import CheckpointError, ModelConfig

# our fused layer -> the checkpoint's layers it holds
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
_OTHER = ("input_layernorm", "post_attention_layernorm")


def checkpoint_modules(cfg: ModelConfig) -> list[str]:
    """Every module name of a Llama/Mistral/Qwen2 checkpoint (Hugging Face names)."""
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{leaf}" for leaf in (*_LINEAR, *_OTHER)]
    return names


def checkpoint_parts(prefix: str) -> list[str]:
    """Our layer ``prefix`` -> the checkpoint layers it holds."""
    head, _, leaf = prefix.rpartition(".")
    return [f"{head}.{part}" for part in FUSED.get(leaf, (leaf,))]


def is_skipped(prefix: str, skipped: Callable[[str], bool], what: str) -> bool:
    """Whether our layer ``prefix`` stays dense, given the checkpoint-name predicate
    ``skipped``; CheckpointError if it would split a fused layer."""
    names = checkpoint_parts(prefix)
    flags = {skipped(n) for n in names}
    if len(flags) > 1:
        raise CheckpointError(
            f"{what} leaves some parts of the fused layer {prefix} ({', '.join(names)}) "
            "unquantized and not the others; kvscale runs them as one layer"
        )
    return flags.pop()


def check_names_exist(names: list[str], cfg: ModelConfig, field: str) -> None:
    """Each entry of a substring skip list (AWQ's ``modules_to_not_convert``) must name
    a module this model has; CheckpointError naming the ones it does not."""
    modules = checkpoint_modules(cfg)
    missing = [n for n in names if not any(n in m for m in modules)]
    if missing:
        raise CheckpointError(
            f"quantization_config.{field} names {missing}, which this "
            f"{cfg.architecture} has no module for (its modules: model.embed_tokens, "
            "model.layers.N.self_attn.{q,k,v,o}_proj, model.layers.N.mlp.{gate,up,down}_proj, "
            "the norms, lm_head)"
        )
