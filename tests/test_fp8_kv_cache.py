"""The FP8 KV cache: K and V stored as E4M3 with per-layer scales, from an llm-compressor
checkpoint's ``kv_cache_scheme`` or calibrated at start-up.

References: transformers running the same checkpoint through compressed-tensors, which
rounds K and V to FP8 with the checkpoint's scales in its attention hook (so the two
should agree up to accumulation order), and kvscale's own full-precision cache."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError
from kvscale.server.worker.kv_calibration import KV_SCALE_HEADROOM
from tests.hf_reference import assert_stable_under_chunking, random_prompts

from .quantized_checkpoints import FP8_KV_CACHE_SCHEME, compress

PROMPTS = random_prompts(24, (3, 60), seed=4)
TOP = 5
# Against transformers + compressed-tensors on the same checkpoint and scales: the two
# round the same K/V to FP8, last-bit differences elsewhere flip a few roundings (as for
# FP8 weights, test_fp8.py).
LOGPROB_ATOL = 0.1
# Against the full-precision cache: FP8's 3 mantissa bits move a random tiny model's
# near-flat logprobs by a few tenths of a nat (measured 0.27 with llm-compressor's own
# observer scales); calibrated scales must do as well as those, within 25%.
FULL_PRECISION_ATOL = 0.75
CALIBRATED_VS_OBSERVER = 1.25


@pytest.fixture(scope="module")
def kv_checkpoints(
    checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """``fp8-kv``: llm-compressor FP8_DYNAMIC weights + FP8 KV scheme; ``dense-kv-scales``:
    the dense checkpoint with that checkpoint's K/V scales added (no ``kv_cache_scheme`` in
    config.json: ``kv_cache_dtype="fp8"`` picks the scales up)."""
    llama = checkpoint_factory("llama", arch="llama")
    out = tmp_path_factory.mktemp("fp8kv")
    fp8kv = compress(llama, out / "fp8-kv", "FP8_DYNAMIC", kv_cache_scheme=FP8_KV_CACHE_SCHEME)
    dense = out / "dense-kv-scales"
    shutil.copytree(llama, dense)
    scales = {k: v for k, v in load_file(fp8kv / "model.safetensors").items() if "_scale" in k}
    scales = {k: v for k, v in scales.items() if k.endswith(("k_scale", "v_scale"))}
    save_file(scales, dense / "kv-scales.safetensors")
    weight_map = {k: "model.safetensors" for k in load_file(dense / "model.safetensors")}
    weight_map.update({k: "kv-scales.safetensors" for k in scales})
    (dense / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {"fp8-kv": fp8kv, "dense-kv-scales": dense, "dense": llama}


def _first_token_logprobs(llm: LLM) -> list[dict[int, float]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=TOP))
    return [{t: e.logprob for t, e in o.outputs[0].logprobs[0].items()} for o in outs]


def _worst(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """Largest logprob difference over the tokens both runs report."""
    return max(abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x.keys() & y.keys())


def test_checkpoint_kv_scales_match_transformers(kv_checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = kv_checkpoints["fp8-kv"]
    llm = LLM(str(path), device="cpu")  # kv_cache_dtype auto: the checkpoint's FP8 scheme
    pool = llm.engine.worker.kv_pool
    assert pool.dtype == torch.float8_e4m3fn and pool.layers[0].k.dtype == torch.float8_e4m3fn
    tensors = load_file(path / "model.safetensors")
    assert pool.k_scales[1] == pytest.approx(float(tensors["model.layers.1.self_attn.k_scale"]))
    assert pool.v_scales[0] == pytest.approx(float(tensors["model.layers.0.self_attn.v_scale"]))
    ours = _first_token_logprobs(llm)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    agree, worst = 0, 0.0
    with torch.no_grad():
        for p, got in zip(PROMPTS, ours, strict=True):
            r = torch.log_softmax(ref(torch.tensor([p])).logits[0, -1].float(), -1)
            agree += int(max(got, key=got.__getitem__) == int(r.argmax()))
            worst = max(worst, *(abs(lp - float(r[t])) for t, lp in got.items()))
    assert worst < LOGPROB_ATOL, worst
    assert agree >= len(PROMPTS) - 1, agree


def test_calibrated_scales_do_as_well_as_llm_compressors(
    kv_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    dense = str(kv_checkpoints["dense"])
    full = _first_token_logprobs(LLM(dense, device="cpu"))
    observer = LLM(str(kv_checkpoints["dense-kv-scales"]), device="cpu", kv_cache_dtype="fp8")
    observer_err = _worst(full, _first_token_logprobs(observer))
    with caplog.at_level(logging.WARNING, logger="kvscale"):
        calibrated = LLM(dense, device="cpu", kv_cache_dtype="fp8")
    assert "calibrating them" in caplog.text  # never silently unit scales
    pool = calibrated.engine.worker.kv_pool
    assert all(s != 1.0 for s in pool.k_scales + pool.v_scales)
    # the headroom over llm-compressor's absmax / 448 observer, within the data's spread
    ratio = pool.k_scales[0] / observer.engine.worker.kv_pool.k_scales[0]
    assert KV_SCALE_HEADROOM / 2 < ratio < KV_SCALE_HEADROOM * 2, ratio
    calibrated_err = _worst(full, _first_token_logprobs(calibrated))
    assert observer_err < FULL_PRECISION_ATOL, observer_err
    assert calibrated_err < FULL_PRECISION_ATOL, calibrated_err
    assert calibrated_err <= CALIBRATED_VS_OBSERVER * observer_err, (calibrated_err, observer_err)


def test_an_fp8_pool_holds_four_times_the_fp32_tokens(llama_ckpt: Path) -> None:
    """On the CPU the pool is 1 GiB by default: one byte an element instead of four."""
    fp32 = LLM(str(llama_ckpt), device="cpu").engine
    fp8 = LLM(str(llama_ckpt), device="cpu", kv_cache_dtype="fp8_e4m3").engine
    assert fp8.worker.kv_pool.nbytes == fp32.worker.kv_pool.nbytes
    assert fp8.stats().kv_blocks_total == 4 * fp32.stats().kv_blocks_total


def test_fp8_cache_greedy_is_stable_under_chunked_prefill_and_preemption(
    kv_checkpoints: dict[str, Path],
) -> None:
    assert_stable_under_chunking(kv_checkpoints["fp8-kv"], PROMPTS, LOGPROB_ATOL)


def test_unsupported_kv_cache_schemes_are_refused(
    kv_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "per-head"
    shutil.copytree(kv_checkpoints["fp8-kv"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme .* is not supported"):
        LLM(str(bad), device="cpu")
