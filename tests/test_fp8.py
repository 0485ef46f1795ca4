"""FP8 checkpoints written by llm-compressor (dynamic per-token and static per-tensor
activations; per-channel and per-tensor weight scales) and FP8 at load, against
transformers loading the same checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.quantization import get_quantization
from kvscale.server.quantization.fp8 import FP8, fp8_linear, quantize_rows
from tests.hf_reference import assert_stable_under_chunking, linear_layer_pairs, random_prompts

from .quantized_checkpoints import compress

PROMPTS = random_prompts(24, (3, 60), seed=4)
TOP = 5  # logprobs compared per position
# The reference is transformers running the same checkpoint through compressed-tensors,
# which rounds each linear layer's input to FP8 by the checkpoint's scheme as kvscale does
# (layer by layer they agree to ~1e-6: test_fp8_layers_match_compressed_tensors). Over a
# whole model the last-bit differences of the two computations (fused vs separate
# projections, accumulation order) flip some FP8 rounding decisions downstream, one FP8
# step being ~6% of a value: the logprobs then differ by up to a few hundredths.
LOGPROB_ATOL = 0.1
LAYER_RTOL = 1e-4  # per layer, relative to the output's largest value


@pytest.fixture(scope="module")
def fp8_checkpoints(
    checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    llama = checkpoint_factory("llama", arch="llama")
    qwen2 = checkpoint_factory("qwen2", arch="qwen2", seed=2)
    out = tmp_path_factory.mktemp("fp8")
    return {
        "llama-dynamic": compress(llama, out / "llama-dyn", "FP8_DYNAMIC"),
        "llama-static": compress(llama, out / "llama-static", "FP8"),
        "qwen2-dynamic": compress(qwen2, out / "qwen2-dyn", "FP8_DYNAMIC"),
    }


def _reference(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference_logprobs(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = _reference(path)
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(torch.log_softmax(model(torch.tensor([p])).logits[0, -1].float(), -1))
    return out


@pytest.mark.parametrize("name", ["llama-dynamic", "llama-static", "qwen2-dynamic"])
def test_fp8_checkpoints_match_transformers(fp8_checkpoints: dict[str, Path], name: str) -> None:
    path = fp8_checkpoints[name]
    llm = LLM(str(path), device="cpu")
    layer = llm.engine.worker.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (layer.out_per_rank,)
    assert llm.engine.worker.model.lm_head.weight.dtype == torch.float32  # ignored: dense
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=TOP))
    ref = _reference_logprobs(path, PROMPTS)
    agree, worst = 0, 0.0
    for o, r in zip(outs, ref, strict=True):
        agree += int(o.outputs[0].token_ids[0] == int(r.argmax()))
        for t, entry in o.outputs[0].logprobs[0].items():
            worst = max(worst, abs(entry.logprob - float(r[t])))
    assert worst < LOGPROB_ATOL, worst
    assert agree >= len(PROMPTS) - 1, agree  # a near-tie may flip one


@pytest.mark.parametrize("name", ["llama-dynamic", "llama-static", "qwen2-dynamic"])
def test_fp8_layers_match_compressed_tensors(fp8_checkpoints: dict[str, Path], name: str) -> None:
    """Every quantized layer, fed the reference's own input: kvscale's loaded layer gives
    compressed-tensors' output."""
    path = fp8_checkpoints[name]
    ref = _reference(path)
    ours = LLM(str(path), device="cpu").engine.worker.model
    for n, _, layer, shard, x, y in linear_layer_pairs(ref, ours, PROMPTS[0]):
        with torch.no_grad():
            out = layer(x).split(layer.output_partition_sizes, dim=-1)[shard]
        err = (out - y).abs().max() / y.abs().max()
        assert err < LAYER_RTOL, (n, float(err))


def test_fp8_greedy_is_stable_under_chunked_prefill_and_preemption(
    fp8_checkpoints: dict[str, Path],
) -> None:
    """Per-token activation scales do not depend on the batch; chunking and preemption
    change only accumulation orders, which may flip one FP8 rounding and so a near tie."""
    assert_stable_under_chunking(fp8_checkpoints["llama-dynamic"], PROMPTS, LOGPROB_ATOL)


def test_fp8_at_load_equals_llm_compressors_fp8_dynamic(
    llama_ckpt: Path, fp8_checkpoints: dict[str, Path]
) -> None:
    """``quantization="fp8"`` on the dense checkpoint quantizes as llm-compressor's
    FP8_DYNAMIC scheme does (per-channel absmax weights, per-token activations): the
    same weights, so the same tokens and logprobs as its checkpoint."""
    online = LLM(str(llama_ckpt), device="cpu", quantization="fp8")
    layer = online.engine.worker.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == FP8
    offline = LLM(str(fp8_checkpoints["llama-dynamic"]), device="cpu")
    ref = offline.engine.worker.model.model.layers[0].mlp.down_proj
    assert torch.equal(layer.weight.view(torch.uint8), ref.weight.view(torch.uint8))
    torch.testing.assert_close(layer.weight_scale, ref.weight_scale)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=TOP, ignore_eos=True)
    a, b = online.generate(PROMPTS, params), offline.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_fp8_linear_matches_the_dequantized_product() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(7, 64), torch.randn(48, 64)
    wq, ws = quantize_rows(w)
    y = fp8_linear(x, wq, ws.view(-1), None)
    xq, xs = quantize_rows(x)
    ref = (xq.float() * xs) @ (wq.float() * ws).T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    rel = ((y - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert rel < 0.05  # FP8's rounding of both operands


def test_tiles_only_on_cuda_at_few_rows_with_the_kernels_routed() -> None:
    from kvscale.server.layers import ops
    from kvscale.server.quantization.fp8 import tile_config, uses_tiles

    # the CPU keeps torch's op whatever the routing (the rule's GPU side:
    # tests/gpu/test_engine_cuda.py, which checks the kernels launched)
    with ops.kernels(True):
        assert not uses_tiles(torch.zeros(1, 64, dtype=FP8))
    assert tile_config(28672).block_n == 128 and tile_config(6144).block_n == 64
    assert all(tile_config(n).block_m == 16 and tile_config(n).tma for n in (1024, 28672))


def _with_quant_config(src: Path, dst: Path, patch: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(patch)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_schemes_and_settings_are_refused(
    fp8_checkpoints: dict[str, Path], llama_ckpt: Path, tmp_path: Path
) -> None:
    src = fp8_checkpoints["llama-dynamic"]
    kv = _with_quant_config(src, tmp_path / "kv", {"kv_cache_scheme": {"num_bits": 8}})
    with pytest.raises(CheckpointError, match="kv_cache_scheme"):
        LLM(str(kv), device="cpu")
    with pytest.raises(CheckpointError, match="does not match"):
        get_quantization(ModelConfig.from_path(src), "none")
    with pytest.raises(CheckpointError, match="dense"):
        get_quantization(ModelConfig.from_path(llama_ckpt), "compressed-tensors")
    other = ModelConfig.from_path(llama_ckpt)
    object.__setattr__(other, "quantization", {"quant_method": "bitsandbytes"})
    with pytest.raises(CheckpointError, match="bitsandbytes"):
        get_quantization(other, None)
