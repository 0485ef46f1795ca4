"""The engine's configuration, defined once: settings, checkpoint facts, resolution.

- ``EngineConfig``: every engine setting with its default, bounds and help text, in
  one dataclass validated on construction. ``kvscale serve``/``generate`` derive their
  flags from its fields (``add_engine_arguments``/``EngineConfig.from_args``) and
  ``LLM(model, **settings)`` takes them as keywords, so a new setting is added here only.
- ``ModelConfig``: the architecture facts of a Hugging Face checkpoint's ``config.json``.
- ``ResolvedConfig``: the settings plus everything derived from them and the checkpoint
  (model folder, context length, EOS ids, device, dtype), built once by
  ``EngineConfig.resolve`` and passed whole to the engine core, the worker and the
  engine process.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from kvscale.bounds import Bound
from kvscale.server.compilation.config import (
    CUDA_GRAPH_MODES,
    DEFAULT_PIECEWISE_MAX_TOKENS,
    DEFAULT_SPLIT_OPS,
    PIECE_COMPILERS,
    check_engine_settings,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
VALID_BLOCK_SIZES = (8, 16, 32, 64, 128)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


# Batch limits left unset (bench/NOTES.md "e83 measured", "e84 measured", r91 and r93 on
# H100s): 1,024 running sequences with decode graphs to 512 rows gave workload B +9-12%
# over 256 and 256 and left C and D unchanged (vLLM's pair for such GPUs); graphs to all
# 1,024 rows then gave B another +0.6-1.9%, the eager steps of 513-1,024 rows' host time.
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_BATCH = (1024, 1024)  # (max_num_seqs, cuda_graph_max_batch)
DEFAULT_BATCH = (256, 256)


def default_batch_limits(gpu_bytes: int | None, speculative: bool) -> tuple[int, int]:
    """``(max_num_seqs, cuda_graph_max_batch)`` for settings left unset: ``LARGE_GPU_BATCH``
    when the smallest GPU the engine runs on has ``gpu_bytes`` >= 70 GiB and there is no
    speculative decoding (which gains at small batches, and whose draft is sized to the
    target's batch), else ``DEFAULT_BATCH``. ``gpu_bytes`` None: no GPU."""
    if gpu_bytes is not None and gpu_bytes >= LARGE_GPU_BYTES and not speculative:
        return LARGE_GPU_BATCH
    return DEFAULT_BATCH


def smallest_gpu_bytes(device: str, tensor_parallel_size: int) -> int | None:
    """Total memory in bytes of the smallest GPU an engine on ``device`` (auto, cuda or
    cuda:N; rank r on GPU r) would use; None on CPU, without CUDA, or when those GPUs are
    not there (``torch_device`` then says so)."""
    index = device.removeprefix("cuda:")
    numbered = index != device
    if device == "cpu" or (numbered and not index.isdigit()) or not torch.cuda.is_available():
        return None
    ids = [int(index)] if numbered else range(tensor_parallel_size)
    if max(ids) >= torch.cuda.device_count():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in ids)


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


# ---- settings ---------------------------------------------------------------------------

# CLI argument groups, in the order ``--help`` shows them.
GROUPS = {
    "model": "model",
    "engine": "engine",
    "compilation": "CUDA graphs and compilation",
    "speculative": "speculative decoding",
}


def setting(
    default: Any,
    help: str,
    *,
    group: str = "engine",
    choices: tuple[Any, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    cli: bool = True,
) -> Any:
    """A field of ``EngineConfig`` with what validation, the CLI and docs need.

    ``choices``/``min``/``max``: allowed values (None always passes: "not set").
    ``cli``: False for settings that are not command-line flags.
    """
    meta = dict(
        help=help,
        group=group,
        choices=choices,
        min=min,
        max=max,
        min_exclusive=min_exclusive,
        cli=cli,
    )
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    """Engine settings (model, cache, scheduler, parallelism, features), validated on
    construction: a bad value raises ValueError naming the setting, the value and what is
    allowed. ``max_num_batched_tokens`` None becomes ``max(8192, max_num_seqs)``."""

    model: str = setting("demo", "checkpoint folder, or 'demo' (built-in)", group="model")
    tokenizer: str | None = setting(None, "tokenizer folder (default: the model's)", group="model")
    dtype: str = setting(
        "auto",
        "auto | float32 | float16 | bfloat16 (auto: the checkpoint's on GPU, float32 on CPU)",
        group="model",
    )
    max_model_len: int | None = setting(
        None, "context length in tokens (default: the model's)", group="model", min=2
    )
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    max_num_seqs: int | None = setting(
        None,
        "sequences per batch (default: 1024 on CUDA GPUs of at least 70 GiB without "
        "speculative decoding, else 256; at most --max-num-batched-tokens)",
        min=1,
    )
    max_num_batched_tokens: int | None = setting(
        None, "new tokens per step (default: max(8192, max-num-seqs))", min=1
    )
    block_size: int = setting(16, "tokens per KV-cache block", choices=VALID_BLOCK_SIZES)
    num_kv_blocks: int | None = setting(
        None, "KV-cache blocks (default: from --gpu-memory-utilization; 1 GiB on CPU)", min=1
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "fraction of GPU memory for weights, activations and KV cache",
        min=0.0,
        max=1.0,
        min_exclusive=True,
    )
    attention_backend: str = setting(
        "auto", "auto | torch | triton (auto: triton on CUDA)", choices=("auto", "torch", "triton")
    )
    enforce_eager: bool = setting(
        False, "run every step eagerly, no CUDA graphs (the same as --cuda-graph-mode none)"
    )
    compile: bool = setting(
        False,
        "torch.compile the layers around attention (Inductor) also for the steps that no "
        "piecewise graph runs (with a piecewise mode: the pieces --piecewise-compiler "
        "made); slower start-up",
    )
    cuda_graph_max_batch: int | None = setting(
        None,
        "largest decode batch captured as a CUDA graph; 0 = none (default: 1024 where "
        "--max-num-seqs defaults to 1024, else 256; at most --max-num-seqs)",
        min=0,
    )
    cuda_graph_mode: str = setting(
        "full_decode_only",
        "auto (full_and_piecewise for an unquantized model, or FP8 weights quantized at load, "
        "on one GPU without speculation, else full_decode_only) | "
        "full_and_piecewise (decode-only steps replay a whole-model graph, other steps up to "
        "the largest captured size replay piecewise graphs around eager attention) | "
        "full_decode_only | piecewise | none; larger steps run eagerly; on CPU nothing is "
        "captured and the piecewise modes run the compiled pieces",
        group="compilation",
        choices=CUDA_GRAPH_MODES,
    )
    piecewise_max_tokens: int = setting(
        DEFAULT_PIECEWISE_MAX_TOKENS,
        "largest step (new tokens) captured as piecewise graphs when "
        "--piecewise-capture-sizes is not given",
        group="compilation",
        min=1,
    )
    piecewise_capture_sizes: str | None = setting(
        None,
        "comma-separated token counts captured as piecewise graphs (default: every 8 "
        "tokens up to 64, 16 up to 128, 32 up to --piecewise-max-tokens); a step pads to "
        "the next one",
        group="compilation",
    )
    piecewise_compiler: str = setting(
        "eager",
        "compiler of each piece: eager (the pieces as traced, with the hand-written Triton "
        "kernels; starts in seconds) | inductor (Inductor fuses each piece; slower start-up)",
        group="compilation",
        choices=PIECE_COMPILERS,
    )
    piecewise_compile_sizes: str | None = setting(
        None,
        "captured sizes each piece is also compiled for with static shapes (default: "
        "none, one dynamic-shape compilation serves every size)",
        group="compilation",
    )
    piecewise_split_ops: str = setting(
        ",".join(DEFAULT_SPLIT_OPS),
        "comma-separated custom ops the compiled graph is split at; they run eagerly "
        "between the captured pieces",
        group="compilation",
    )
    compile_cache_dir: str = setting(
        "/tmp/kvscale/compile-cache",
        "folder keeping compiled pieces between starts ('' = not kept)",
        group="compilation",
    )
    compile_debug: bool = setting(
        False,
        "check CUDA-graph input addresses on every replay and write the split graph to "
        "the cache folder",
        group="compilation",
    )
    seed: int = setting(0, "seed of unseeded sampling")
    enable_prefix_caching: bool = setting(
        True,
        "reuse the KV cache of shared prompt prefixes (hash-chained full blocks; a request's "
        "cache_salt isolates tenants)",
    )
    quantization: str | None = setting(
        None,
        "auto (default: as the checkpoint's config.json says) | none | fp8 (FP8 W8A8; on a "
        "dense checkpoint, quantized at load) | compressed-tensors | awq | gptq (4-bit "
        "weight checkpoints)",
        choices=("auto", "none", "fp8", "compressed-tensors", "awq", "gptq"),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto (the model dtype, or FP8 when the checkpoint has an FP8 kv_cache_scheme) | fp8 | "
        "fp8_e4m3 (FP8 E4M3 with per-layer scales: the checkpoint's, else calibrated at start)",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    speculative_method: str | None = setting(
        None,
        "speculative decoding: ngram (prompt lookup, no model) | draft (a draft model, "
        "--speculative-model); drafted tokens are verified exactly against this model",
        group="speculative",
        choices=("ngram", "draft"),
    )
    speculative_model: str | None = setting(
        None,
        "the draft: a checkpoint folder (placement inprocess) or the sidecar's socket "
        "(unix:///path, placement sidecar; see kvscale serve-draft)",
        group="speculative",
    )
    speculative_placement: str | None = setting(
        None,
        "where the draft runs: inprocess (this engine's process and device) | sidecar "
        "(another process on a Unix socket); default: sidecar for a unix:// model, else "
        "inprocess",
        group="speculative",
        choices=("inprocess", "sidecar"),
    )
    num_speculative_tokens: int = setting(
        4, "most tokens drafted per sequence and step", group="speculative", min=1, max=16
    )
    ngram_min: int = setting(
        2, "n-gram: shortest suffix that may match", group="speculative", min=1, max=16
    )
    ngram_max: int = setting(
        4, "n-gram: longest suffix tried first", group="speculative", min=1, max=16
    )
    speculative_disable_by_batch_size: int = setting(
        16,
        "speculation pauses while more sequences than this run (measured on an H100 with "
        "a 2-layer draft of an 8B-shaped target: 0.59x the time per token at batch 1, "
        "0.67x at 16; larger batches are not measured); the steps are pipelined again",
        group="speculative",
        min=1,
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks one model is sharded over: one process per GPU of this node (NCCL), or "
        "per CPU process with --device cpu (gloo)",
        min=1,
    )
    watchdog_timeout: float = setting(
        300.0,
        "with tensor parallelism: seconds a step may wait on the ranks before the engine "
        "gives up (a rank that hangs); the server then exits non-zero",
        min=0.0,
        min_exclusive=True,
    )
    disable_custom_all_reduce: bool = setting(
        False,
        "with tensor parallelism on GPUs: every all-reduce on NCCL, none in the one-shot "
        "kernel that writes into the other GPUs' memory (sums of up to 2,048 tokens, fused "
        "with the residual add and RMSNorm after them)",
    )
    # True: step() returns every request's state each step (servers stream it);
    # False: only finished requests, and text is detokenized once at the end.
    stream_outputs: bool = setting(True, "report every step's outputs", cli=False)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            _check_setting(f, getattr(self, f.name), hints[f.name])
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.max_num_seqs is None or self.cuda_graph_max_batch is None:
            gpu = smallest_gpu_bytes(self.device, self.tensor_parallel_size)
            seqs, graphs = default_batch_limits(gpu, self.speculative_method is not None)
            if self.max_num_seqs is None:
                self.max_num_seqs = min(seqs, self.max_num_batched_tokens or seqs)
            if self.cuda_graph_max_batch is None:  # no graph larger than a step can be
                self.cuda_graph_max_batch = min(graphs, self.max_num_seqs)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        check_engine_settings(self)
        check_speculative(self)
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"device={self.device!r} with tensor_parallel_size={self.tensor_parallel_size}: "
                "rank r runs on GPU r of those visible; use device 'cuda' (or 'auto') and "
                "CUDA_VISIBLE_DEVICES to choose the GPUs"
            )

    @property
    def draft_placement(self) -> str | None:
        """Where the draft model runs (None: no draft model)."""
        if self.speculative_method != "draft":
            return None
        if self.speculative_placement:
            return self.speculative_placement
        return "sidecar" if (self.speculative_model or "").startswith("unix://") else "inprocess"

    # ---- the command line -------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The settings from flags that ``add_engine_arguments`` added."""
        return cls(**engine_settings(args))

    # ---- resolution -------------------------------------------------------------------
    def resolve_model_path(self) -> str:
        """The checkpoint folder (the demo checkpoint is built on first use)."""
        return resolve_model_path(self.model)

    def torch_device(self) -> torch.device:
        """The device (rank 0's); ValueError if a GPU was asked for and none is available,
        or if fewer GPUs are visible than ``tensor_parallel_size`` needs."""
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but no CUDA GPU is available")
        else:
            device = torch.device(self.device)
        if device.type == "cuda" and self.tensor_parallel_size > 1:
            from kvscale.server.distributed.group import check_gpus

            check_gpus(self.tensor_parallel_size, torch.cuda.device_count())
        return device

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

    def load(self) -> tuple[ResolvedConfig, Any]:
        """The resolved configuration and the tokenizer: the checkpoint is read (and
        checked) first, then the tokenizer, whose EOS id joins the checkpoint's."""
        from kvscale.server.tokenizer import load_tokenizer

        path = self.resolve_model_path()
        ModelConfig.from_path(path)  # a bad checkpoint is named before a missing tokenizer
        tokenizer = load_tokenizer(self.tokenizer or path)
        return replace(self, model=path).resolve(tokenizer), tokenizer

    def resolve(self, tokenizer: Any = None) -> ResolvedConfig:
        """Reads the checkpoint (building the demo one if asked for) and derives what
        the engine runs with. ``tokenizer``: its EOS id joins the checkpoint's.
        Raises CheckpointError or ValueError with the reason."""
        path = self.resolve_model_path()
        model = ModelConfig.from_path(path)
        from kvscale.kernels.fp8 import is_fp8
        from kvscale.server.quantization import get_quantization
        from kvscale.server.quantization.kv_cache import resolve_kv_cache_dtype
        from kvscale.server.worker.kv_calibration import calibration_ids

        get_quantization(model, self.quantization)  # refuses formats not implemented
        check_tensor_parallel(model, self.tensor_parallel_size)
        device = self.torch_device()
        dtype = self.torch_dtype(model, device)
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, model, dtype)
        calibration = calibration_ids(tokenizer, model.vocab_size) if is_fp8(kv_dtype) else ()
        return ResolvedConfig(
            engine=replace(self, model=path),
            model=model,
            max_model_len=self.resolve_max_model_len(model),
            eos_token_ids=frozenset(eos_token_ids(Path(path), model, tokenizer)),
            device=str(device),
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            calibration_ids=calibration,
        )


def check_speculative(cfg: EngineConfig) -> None:
    """The speculative settings fit together; ValueError saying what to change."""
    method, model = cfg.speculative_method, cfg.speculative_model
    if cfg.ngram_min > cfg.ngram_max:
        raise ValueError(f"ngram_min={cfg.ngram_min} must be <= ngram_max={cfg.ngram_max}")
    if method == "draft" and not model:
        raise ValueError(
            "speculative_method='draft' needs speculative_model: a draft checkpoint folder, "
            "or unix:///path of a kvscale serve-draft sidecar"
        )
    if method != "draft" and (model or cfg.speculative_placement):
        raise ValueError(
            f"speculative_model/placement are for speculative_method='draft' "
            f"(speculative_method={method!r}, speculative_model={model!r})"
        )
    if method == "draft" and model:
        placement = cfg.draft_placement
        if (placement == "sidecar") != model.startswith("unix://"):
            raise ValueError(
                f"speculative_placement={placement!r} with speculative_model={model!r}: a "
                "sidecar is reached at unix:///path/to.sock, an inprocess draft is a "
                "checkpoint folder"
            )


def _check_setting(f: Field[Any], value: Any, hint: Any) -> None:
    """Type, bounds and choices of one setting; ValueError naming it."""
    meta = f.metadata
    if value is None:
        if type(None) not in typing.get_args(hint):
            raise ValueError(f"{f.name} must be set")
        return
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if base is bool and not isinstance(value, bool):
        raise ValueError(f"{f.name} must be true or false, got {value!r}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{f.name} must be an integer, got {value!r}")
    if base is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{f.name} must be a number, got {value!r}")
    if base is str and not isinstance(value, str):
        raise ValueError(f"{f.name} must be a string, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"{f.name} must be one of {meta['choices']}, got {value!r}")
    if base in (int, float):
        why = Bound(meta["min"], meta["max"], meta["min_exclusive"]).refusal(f.name, value)
        if why is not None:
            raise ValueError(why)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig``'s keywords from parsed ``add_engine_arguments`` flags."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.metadata["cli"]}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per ``EngineConfig`` setting (``--max-num-seqs`` for ``max_num_seqs``),
    grouped as in ``GROUPS``; values are validated by ``EngineConfig`` itself."""
    hints = typing.get_type_hints(EngineConfig)
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for f in fields(EngineConfig):
        meta = f.metadata
        if not meta["cli"]:
            continue
        flag = "--" + f.name.replace("_", "-")
        group = groups[meta["group"]]
        base = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), None)
        base = base or hints[f.name]
        if base is bool:  # on by default: --no-FLAG turns it off
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag, action=action, default=f.default, help=meta["help"])
            continue
        default = "" if f.default in (None, MISSING) else " (default: %(default)s)"
        group.add_argument(flag, type=base, default=f.default, help=meta["help"] + default)


# ---- the checkpoint -----------------------------------------------------------------------


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
    quantization: dict[str, Any] | None = None  # config.json's quantization_config

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
            quantization=cfg.get("quantization_config"),
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
        if not cfg.get("quantization_config"):
            legacy = legacy_quantization_config(p)
            if legacy is not None:
                cfg["quantization_config"] = legacy
        try:
            return cls.from_dict(cfg)
        except KeyError as e:
            raise CheckpointError(f"{cfg_file} lacks the field {e.args[0]!r}") from e


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """ValueError naming the model's dimension that ``tp`` ranks cannot split: attention
    heads and the MLP's intermediate size must divide by ``tp``; KV heads must divide by
    ``tp``, or ``tp`` by them (then each KV head is replicated on ``tp / kv_heads`` ranks)."""
    if tp == 1:
        return
    why = None
    if model.num_heads % tp:
        why = f"num_attention_heads={model.num_heads} is not divisible by it"
    elif model.num_kv_heads % tp and tp % model.num_kv_heads:
        why = (
            f"num_key_value_heads={model.num_kv_heads} neither divides by it nor divides it "
            "(KV heads are split over ranks, or replicated when fewer than ranks)"
        )
    elif model.intermediate_size % tp:
        why = f"intermediate_size={model.intermediate_size} is not divisible by it"
    if why:
        raise ValueError(f"tensor_parallel_size={tp} cannot shard this model: {why}")


def legacy_quantization_config(path: Path) -> dict[str, Any] | None:
    """The quantization settings that AutoGPTQ (``quantize_config.json``) and AutoAWQ
    (``quant_config.json``) keep beside ``config.json``, for checkpoints whose config.json
    has no ``quantization_config`` (vLLM reads them too); ``quant_method`` is inferred
    when absent (AutoAWQ's keys: ``w_bit``, ``q_group_size``, ``zero_point``, ``version``)."""
    for name in ("quantize_config.json", "quant_config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            raw = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{f} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise CheckpointError(f"{f} must hold a JSON object")
        if "quant_method" not in raw:
            awq = any(k in raw for k in ("w_bit", "q_group_size", "zero_point", "version"))
            raw["quant_method"] = "awq" if awq else "gptq"
        return raw
    return None


def resolve_model_path(model: str) -> str:
    """``"demo"`` is the built-in random-weight demo checkpoint (built on first use)."""
    if model == "demo":
        from kvscale.server.demo_model import demo_model_path

        return str(demo_model_path())
    return str(Path(model))


def eos_token_ids(path: Path, cfg: ModelConfig, tokenizer: Any = None) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer."""
    ids = set(cfg.eos_token_ids)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if isinstance(eos, list):
            ids.update(int(e) for e in eos)
        elif eos is not None:
            ids.add(int(eos))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


# ---- resolved ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedConfig:
    """What one engine runs with, built once by ``EngineConfig.resolve`` and passed whole
    (it is picklable: the engine process receives it as is)."""

    engine: EngineConfig  # ``model`` is the checkpoint folder
    model: ModelConfig
    max_model_len: int  # tokens: prompt + output
    eos_token_ids: frozenset[int]
    device: str  # "cpu", "cuda", "cuda:N"
    dtype: torch.dtype  # weights and activations
    kv_cache_dtype: torch.dtype  # the model dtype, or FP8
    calibration_ids: tuple[int, ...] = ()  # tokens that calibrate FP8 KV scales if needed

    @property
    def max_num_batched_tokens(self) -> int:
        return int(self.engine.max_num_batched_tokens or 0)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
