"""Hugging Face ``fp8`` checkpoints with block-wise weight scales (transformers'
FineGrainedFP8 layout), against transformers loading the same files.

transformers has no CPU kernel for these: on a CPU it dequantizes the weights at load
(its own ``Fp8Dequantize``) and runs the layers in full precision, while kvscale also
quantizes each layer's input per token and group of 128 columns, as the GPU path does.
So the weights must be the same numbers exactly, each layer must equal transformers'
layer applied to the FP8-rounded input, and whole-model logprobs differ by the
activation rounding alone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvscale.kernels.fp8_gemm import dequantize_blocks
from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError
from kvscale.server.quantization.fp8 import FP8
from tests.hf_reference import assert_stable_under_chunking, linear_layer_pairs, random_prompts

from .quantized_checkpoints import block_fp8

PROMPTS = random_prompts(24, (3, 60), seed=4)
TOP = 5
LAYER_RTOL = 1e-5  # per layer, relative to the output's largest value
# Whole model: last-bit differences flip a few FP8 roundings downstream (test_fp8.py).
LOGPROB_ATOL = 0.1


@pytest.fixture(scope="module")
def block_checkpoints(
    checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fp8-block")
    return {
        "llama-128": block_fp8(checkpoint_factory("llama", arch="llama"), out / "llama"),
        "qwen2-64": block_fp8(
            checkpoint_factory("qwen2", arch="qwen2", seed=2), out / "qwen2", (64, 64)
        ),
    }


def _reference(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _fp8_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """The published activation scheme, written out: per token and ``group`` columns,
    scale = absmax / 448, round to E4M3, multiply back."""
    g = x.reshape(x.shape[0], -1, group)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).reshape(x.shape)


@pytest.mark.parametrize("name", ["llama-128", "qwen2-64"])
def test_block_fp8_layers_match_transformers(block_checkpoints: dict[str, Path], name: str):
    path = block_checkpoints[name]
    group = json.loads((path / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ][1]
    ref = _reference(path)
    ours = LLM(str(path), device="cpu").engine.worker.model
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    for n, hf, layer, shard, x, _ in linear_layer_pairs(ref, ours, PROMPTS[0]):
        rows = slice(
            sum(layer.output_partition_sizes[:shard]),
            sum(layer.output_partition_sizes[: shard + 1]),
        )
        # the weights: transformers' dequantization of the file == kvscale's blocks
        block = layer.linear_method.block
        mine = dequantize_blocks(layer.weight, layer.weight_scale_inv, block)[rows]
        assert torch.equal(mine, hf.weight.float()), n
        # the layer: transformers' layer on the FP8-rounded input
        with torch.no_grad():
            out = layer(x).split(layer.output_partition_sizes, dim=-1)[shard]
            expect = hf(_fp8_round_trip(x, group))
        err = (out - expect).abs().max() / expect.abs().max()
        assert err < LAYER_RTOL, (n, float(err))


def test_block_fp8_model_tracks_transformers(block_checkpoints: dict[str, Path]) -> None:
    """transformers with every quantized layer's input rounded by the published scheme
    (a pre-hook) computes what kvscale computes: logprobs agree up to the accumulation
    order (as for the compressed-tensors FP8 checkpoints, test_fp8.py)."""
    path = block_checkpoints["llama-128"]
    outs = LLM(str(path), device="cpu").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    )
    ref = _reference(path)
    for n, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            m.register_forward_pre_hook(lambda mod, a: (_fp8_round_trip(a[0][0], 128)[None],))
    agree, worst = 0, 0.0
    with torch.no_grad():
        for o, p in zip(outs, PROMPTS, strict=True):
            r = torch.log_softmax(ref(torch.tensor([p])).logits[0, -1].float(), -1)
            agree += int(o.outputs[0].token_ids[0] == int(r.argmax()))
            for t, e in o.outputs[0].logprobs[0].items():
                worst = max(worst, abs(e.logprob - float(r[t])))
    assert worst < LOGPROB_ATOL, worst
    assert agree >= len(PROMPTS) - 1, agree  # a near tie may flip one


def test_block_fp8_greedy_is_stable_under_chunked_prefill_and_preemption(
    block_checkpoints: dict[str, Path],
) -> None:
    assert_stable_under_chunking(block_checkpoints["qwen2-64"], PROMPTS, LOGPROB_ATOL)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_block_size": None}, "per-tensor FP8 is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": [96, 128]}, "does not split into"),
        ({"modules_to_not_convert": ["q_proj"]}, "splits the fused layer"),
    ],
)
def test_unsupported_fp8_variants_are_refused(
    block_checkpoints: dict[str, Path], tmp_path: Path, change: dict, message: str
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(block_checkpoints["llama-128"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        LLM(str(bad), device="cpu")
