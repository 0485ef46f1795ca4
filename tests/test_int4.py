"""4-bit weight checkpoints (W4A16): compressed-tensors written by llm-compressor's GPTQ
and AWQ modifiers, the legacy AutoAWQ GEMM and GPTQ (v1/v2, act-order) layouts, against
transformers on the same weights; sharded loading; unsupported variants refused."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError, EngineConfig, ModelConfig
from kvscale.server.quantization import DenseLinearMethod as Dense
from kvscale.server.quantization import get_quantization
from tests.hf_reference import random_prompts

from . import int4_checkpoints as ck

PROMPTS = random_prompts(12, (3, 60), seed=5)
TOP = 5
# W4A16 runs in fp32 on the CPU: kvscale and transformers compute the same dequantized
# weights, so logprobs differ only by accumulation order.
EXACT_ATOL = 2e-3
# Legacy layouts store fp16 scales (AutoAWQ, GPTQ); the reference keeps llm-compressor's
# fp32 ones: a relative 2^-11 difference per scale.
FP16_SCALES_ATOL = 0.03
KV_BLOCKS = 64  # 1,024 tokens: enough for every test here, far less than the CPU default


@pytest.fixture(scope="module")
def int4(
    checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """``int4(name)`` -> a 4-bit checkpoint, built on first use."""
    out = tmp_path_factory.mktemp("int4")
    cache: dict[str, Path] = {}

    def llama() -> Path:
        return checkpoint_factory("llama", arch="llama")

    def qwen2() -> Path:
        return checkpoint_factory("qwen2", arch="qwen2", seed=2)

    recipes: dict[str, Callable[[], Path]] = {
        # llm-compressor: (model, modifier, symmetric, group size)
        "llama-gptq": lambda: ck.oneshot_int4(llama(), out / "a", "gptq", True, 128),
        "llama-awq-asym": lambda: ck.oneshot_int4(llama(), out / "b", "awq", False, 128),
        "qwen2-gptq-asym-g32": lambda: ck.oneshot_int4(qwen2(), out / "c", "gptq", False, 32),
        "qwen2-awq-g64": lambda: ck.oneshot_int4(qwen2(), out / "d", "awq", True, 64),
        "llama-rtn-channel-asym": lambda: ck.oneshot_int4(llama(), out / "e", "rtn", False, None),
        # legacy layouts of the same weights
        "awq-from-llama-awq-asym": lambda: ck.write_awq(get("llama-awq-asym"), out / "f", 128),
        "awq-from-qwen2-awq-g64": lambda: ck.write_awq(get("qwen2-awq-g64"), out / "g", 64),
        "awq-skip-mlp1": lambda: ck.write_awq(
            get("llama-awq-asym"), out / "h", 128, skip=["layers.1.mlp"]
        ),
        "gptq-v1-from-qwen2-gptq-asym-g32": lambda: ck.write_gptq(
            get("qwen2-gptq-asym-g32"), out / "i", 32, v1=True
        ),
        "gptq-v2-from-qwen2-gptq-asym-g32": lambda: ck.write_gptq(
            get("qwen2-gptq-asym-g32"), out / "j", 32, v1=False
        ),
        "gptq-v1-from-llama-gptq": lambda: ck.write_gptq(get("llama-gptq"), out / "k", 128, True),
        # act order; its dense dequantized reference is "<name>-ref"
        "gptq-act-order": lambda: act("gptq-act-order", llama(), "gptq", 32, False, 0),
        "ct-act-order": lambda: act("ct-act-order", qwen2(), "compressed-tensors", 64, True, 1),
        "awq-rtn": lambda: act("awq-rtn", qwen2(), "awq", 32, False, 0, act_order=False),
    }

    def act(
        name: str, dense: Path, layout: str, group: int, sym: bool, seed: int, act_order=True
    ) -> Path:
        dst, ref = ck.write_rtn(
            dense, out / name, out / f"{name}-ref", layout, group, sym, act_order, seed
        )
        cache[f"{name}-ref"] = ref
        return dst

    def get(name: str) -> Path:
        if name not in cache:
            if name.endswith("-ref"):
                get(name.removesuffix("-ref"))
            else:
                cache[name] = recipes[name]()
        return cache[name]

    return get


@functools.cache
def _reference(path: Path) -> list[torch.Tensor]:
    """transformers on ``path`` (compressed-tensors decompresses W4A16 on load): the
    last position's logprobs for each of ``PROMPTS``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1) for p in PROMPTS]


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), device="cpu", num_kv_blocks=KV_BLOCKS, **kw)


def _ours(llm: LLM) -> list[dict[int, float]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=TOP))
    return [{t: e.logprob for t, e in o.outputs[0].logprobs[0].items()} for o in outs]


def _compare(ours: list[dict[int, float]], ref: list[torch.Tensor]) -> tuple[float, int]:
    """(largest logprob difference over our top tokens, prompts whose argmax agrees)."""
    worst, agree = 0.0, 0
    for o, r in zip(ours, ref, strict=True):
        worst = max(worst, *(abs(lp - float(r[t])) for t, lp in o.items()))
        agree += int(max(o, key=o.__getitem__) == int(r.argmax()))
    return worst, agree


def _layer(llm: LLM, i: int = 0, name: str = "self_attn.qkv_proj") -> torch.nn.Module:
    module = llm.engine.worker.model.model.layers[i]
    for part in name.split("."):
        module = getattr(module, part)
    return module


def _canonical(llm: LLM) -> list[tuple[torch.Tensor, ...]]:
    """Every int4 layer's kernel-layout tensors, in model order."""
    out = []
    for m in llm.engine.worker.model.modules():
        if hasattr(m, "w4_qweight"):
            z = m.w4_zeros if m.w4_zeros is not None else torch.full_like(m.w4_scales, 8)
            out.append((m.w4_qweight, m.w4_scales, z.to(torch.uint8)))
    return out


# ---- llm-compressor checkpoints -------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "llama-gptq",
        "llama-awq-asym",
        "qwen2-gptq-asym-g32",
        "qwen2-awq-g64",
        "llama-rtn-channel-asym",
    ],
)
def test_llm_compressor_w4a16_matches_transformers(int4: Callable[[str], Path], name: str) -> None:
    path = int4(name)
    llm = _llm(path)
    layer = _layer(llm)
    assert layer.w4_qweight.dtype == torch.int32 and not hasattr(layer, "weight")
    assert (layer.w4_zeros is None) == ("asym" not in name)
    assert llm.engine.worker.model.lm_head.weight.dtype == torch.float32  # ignored: dense
    worst, agree = _compare(_ours(llm), _reference(path))
    assert worst < EXACT_ATOL, worst
    assert agree == len(PROMPTS)


# ---- AutoAWQ GEMM --------------------------------------------------------------------
def test_awq_layout_reads_back_with_compressed_tensors_converter(
    int4: Callable[[str], Path],
) -> None:
    """The AWQ writer checked by an independent unpacker: compressed-tensors'
    ``AutoAWQConverter`` turns the AWQ tensors back into the llm-compressor checkpoint's
    packed codes and zero points (and its scales, rounded to fp16 as AutoAWQ stores them)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    src, awq = int4("llama-awq-asym"), int4("awq-from-llama-awq-asym")
    original, written = ck.read_tensors(src), ck.read_tensors(awq)
    quant = json.loads((awq / "config.json").read_text())["quantization_config"]
    back = AutoAWQConverter.from_autoawq_config(quant).process(dict(written))
    for mod in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        assert torch.equal(back[f"{mod}.weight_packed"], original[f"{mod}.weight_packed"])
        assert torch.equal(back[f"{mod}.weight_zero_point"], original[f"{mod}.weight_zero_point"])
        torch.testing.assert_close(
            back[f"{mod}.weight_scale"].float(), original[f"{mod}.weight_scale"].half().float()
        )
        codes = ck.ct_layers(src)[mod]["codes"]
        assert torch.equal(ck.bytes_unpack_cols(written[f"{mod}.qweight"], ck.AWQ_ORDER_MAP), codes)


@pytest.mark.parametrize(
    "name,source",
    [("awq-from-llama-awq-asym", "llama-awq-asym"), ("awq-from-qwen2-awq-g64", "qwen2-awq-g64")],
)
def test_awq_checkpoint_matches_its_source(
    int4: Callable[[str], Path], name: str, source: str
) -> None:
    """kvscale loads the AWQ layout into the same codes and zero points as the
    compressed-tensors checkpoint it was written from (scales: fp16-rounded), and its
    logprobs match transformers on that checkpoint."""
    llm = _llm(int4(name))
    same = _llm(int4(source))
    for (q, s, z), (q2, s2, z2) in zip(_canonical(llm), _canonical(same), strict=True):
        assert torch.equal(q, q2) and torch.equal(z, z2)
        torch.testing.assert_close(s, s2.half().float(), rtol=0, atol=0)
    worst, agree = _compare(_ours(llm), _reference(int4(source)))
    assert worst < FP16_SCALES_ATOL, worst
    assert agree >= len(PROMPTS) - 1


def test_awq_modules_to_not_convert(int4: Callable[[str], Path]) -> None:
    """Layers named by modules_to_not_convert load dense (here: the second layer's MLP,
    written dequantized) and the model still matches the reference."""
    llm = _llm(int4("awq-skip-mlp1"))
    assert _layer(llm, 1, "mlp.gate_up_proj").weight.dtype == torch.float32
    assert _layer(llm, 1, "mlp.down_proj").weight.dtype == torch.float32
    assert hasattr(_layer(llm, 0, "mlp.down_proj"), "w4_qweight")
    worst, _ = _compare(_ours(llm), _reference(int4("llama-awq-asym")))
    assert worst < FP16_SCALES_ATOL, worst


# ---- GPTQ ------------------------------------------------------------------------------
def test_gptq_layout_reads_back_bytewise(int4: Callable[[str], Path]) -> None:
    """The GPTQ writers checked by an independent unpacker (nibbles read from each
    word's bytes): v2 qzeros hold the zero points, v1 qzeros + 0x11111111 (per word, mod
    2^32) hold them, qweight holds the codes."""
    src = int4("qwen2-gptq-asym-g32")
    layers = ck.ct_layers(src)
    v1 = ck.read_tensors(int4("gptq-v1-from-qwen2-gptq-asym-g32"))
    v2 = ck.read_tensors(int4("gptq-v2-from-qwen2-gptq-asym-g32"))
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        assert torch.equal(ck.bytes_unpack_rows(v1[f"{mod}.qweight"]), layers[mod]["codes"])
        assert torch.equal(ck.bytes_unpack_cols(v2[f"{mod}.qzeros"]), layers[mod]["zeros"])
        words = [(int(w) + 0x11111111) % 2**32 for w in v1[f"{mod}.qzeros"].flatten().tolist()]
        back = torch.tensor(words, dtype=torch.int64).view(v1[f"{mod}.qzeros"].shape)
        back = torch.where(back >= 2**31, back - 2**32, back).int()
        assert torch.equal(ck.bytes_unpack_cols(back), layers[mod]["zeros"])


@pytest.mark.parametrize(
    "name", ["gptq-v1-from-qwen2-gptq-asym-g32", "gptq-v2-from-qwen2-gptq-asym-g32"]
)
def test_gptq_v1_and_v2_load_the_same_weights(int4: Callable[[str], Path], name: str) -> None:
    llm = _llm(int4(name))
    source = _llm(int4("qwen2-gptq-asym-g32"))
    for (q, s, z), (q2, s2, z2) in zip(_canonical(llm), _canonical(source), strict=True):
        assert torch.equal(q, q2) and torch.equal(z, z2)
        torch.testing.assert_close(s, s2.half().float(), rtol=0, atol=0)
    worst, agree = _compare(_ours(llm), _reference(int4("qwen2-gptq-asym-g32")))
    assert worst < FP16_SCALES_ATOL, worst
    assert agree >= len(PROMPTS) - 1


def test_gptq_mixing_v1_and_v2_zero_points_is_wrong(
    int4: Callable[[str], Path], tmp_path: Path
) -> None:
    """The same v1 tensors declared v2: every zero point is read one too low, and the
    model's outputs move far from the reference. kvscale follows the declared format."""
    v1 = int4("gptq-v1-from-qwen2-gptq-asym-g32")
    wrong = ck.relabel(v1, tmp_path / "mislabeled", checkpoint_format="gptq_v2")
    right = _llm(v1)
    mixed = _llm(wrong)
    for (_, _, z), (_, _, zm) in zip(_canonical(right), _canonical(mixed), strict=True):
        assert torch.equal((z.int() - 1) % 16, zm.int())
    ref = _reference(int4("qwen2-gptq-asym-g32"))
    assert _compare(_ours(mixed), ref)[0] > 10 * FP16_SCALES_ATOL


def test_gptq_symmetric_zero_is_eight_in_either_format(
    int4: Callable[[str], Path], tmp_path: Path
) -> None:
    """Symmetric checkpoints store 7 (v1) or 8 (v2, also found under the v1 name): both
    load with zero 8; any other stored value is refused."""
    v1 = int4("gptq-v1-from-llama-gptq")
    key = "model.layers.0.mlp.up_proj.qzeros"
    assert set(ck.bytes_unpack_cols(ck.read_tensors(v1)[key]).unique().tolist()) == {7}
    base = _ours(_llm(v1))
    assert _compare(base, _reference(int4("llama-gptq")))[0] < FP16_SCALES_ATOL
    as_v2 = ck.relabel(v1, tmp_path / "v2-label", checkpoint_format="gptq_v2")
    assert _ours(_llm(as_v2)) == base
    bad = tmp_path / "bad"
    shutil.copytree(v1, bad)
    t = ck.read_tensors(bad)
    t[key] = torch.full_like(t[key], 0x55555555)  # zero points of 5: not symmetric
    ck.save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="sym is true but the qzeros"):
        _llm(bad)


def test_legacy_quantize_config_json(int4: Callable[[str], Path], tmp_path: Path) -> None:
    """A GPTQ checkpoint whose settings are only in AutoGPTQ's quantize_config.json (no
    quant_method, no quantization_config in config.json) loads as the same model; an
    AutoAWQ quant_config.json is recognised by its keys."""
    src = int4("gptq-v1-from-llama-gptq")
    dst = tmp_path / "side-file"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    del quant["quant_method"]
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quantize_config.json").write_text(json.dumps(quant))
    assert ModelConfig.from_path(dst).quantization["quant_method"] == "gptq"
    assert _ours(_llm(dst)) == _ours(_llm(src))
    (dst / "quantize_config.json").unlink()
    (dst / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 128}))
    assert ModelConfig.from_path(dst).quantization["quant_method"] == "awq"


# ---- act order -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gptq-act-order", "ct-act-order", "awq-rtn"])
def test_rtn_checkpoints_match_the_dequantized_reference(
    int4: Callable[[str], Path], name: str
) -> None:
    """Act-order GPTQ and compressed-tensors checkpoints (and the AWQ layout the GPU
    tests use) against transformers on the dense dequantized weights."""
    llm = _llm(int4(name))
    layer = _layer(llm, 0, "mlp.down_proj")
    if "act-order" in name:  # rows sorted into whole groups, activations permuted
        assert layer.w4_perm is not None and layer.w4_g_idx is None
    worst, agree = _compare(_ours(llm), _reference(int4(f"{name}-ref")))
    assert worst < EXACT_ATOL, worst
    assert agree >= len(PROMPTS) - 1


def test_greedy_is_stable_under_chunked_prefill_and_preemption(
    int4: Callable[[str], Path],
) -> None:
    """A mixed batch (prompts of 3-60 tokens, 6 new tokens each) run with chunked
    prefill (16 tokens a step) and too few KV blocks (sequences are preempted) gives the
    plain run's greedy tokens; where a sequence departs, it was a near tie in the plain
    run (only the accumulation order differs)."""
    path = int4("gptq-act-order")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP)
    base = [o.outputs[0] for o in _llm(path).generate(PROMPTS, params)]
    llm = LLM(
        str(path),
        device="cpu",
        max_num_batched_tokens=16,
        max_num_seqs=16,
        num_kv_blocks=14,
        max_model_len=96,
        block_size=8,
    )
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.stats().num_preemptions > 0
    identical = 0
    for b, o in zip(base, outs, strict=True):
        got = o.outputs[0].token_ids
        pairs = enumerate(zip(b.token_ids, got, strict=True))
        j = next((i for i, (x, y) in pairs if x != y), None)
        if j is None:
            identical += 1
            continue
        gap = b.logprobs[j][b.token_ids[j]].logprob - b.logprobs[j][got[j]].logprob
        assert gap < 1e-3, (j, gap)
    assert identical >= len(PROMPTS) - 1, identical


# ---- tensor-parallel shards ------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["awq-from-llama-awq-asym", "gptq-act-order", "qwen2-gptq-asym-g32"]
)
def test_each_rank_loads_its_shard(int4: Callable[[str], Path], name: str) -> None:
    """Layers built for rank r of 2 from the full checkpoint tensors (packed dims and
    group scales sliced by the sharding metadata; act-order row-parallel layers keep
    every group): column-parallel outputs concatenate and row-parallel partial sums add
    up to the single-rank layer's output."""
    from kvscale.server.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from kvscale.server.parallel import ParallelState

    path = int4(name)
    cfg = ModelConfig.from_path(path)
    quant = get_quantization(cfg, None)
    assert quant is not None
    tensors = ck.read_tensors(path)
    prefix = "model.layers.0"

    def build(rank: int, world: int) -> dict[str, torch.nn.Module]:
        p = ParallelState(rank, world)
        hd = cfg.head_dim
        layers = {
            "qkv": QKVParallelLinear(
                cfg.hidden_size, hd, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, p,
                quant.linear_method(f"{prefix}.self_attn.qkv_proj"),
            ),
            "gate_up": MergedColumnParallelLinear(
                cfg.hidden_size, [cfg.intermediate_size] * 2, False, p,
                quant.linear_method(f"{prefix}.mlp.gate_up_proj"),
            ),
            "o": RowParallelLinear(
                cfg.num_heads * hd, cfg.hidden_size, False, p,
                quant.linear_method(f"{prefix}.self_attn.o_proj"), reduce_results=False,
            ),
            "down": RowParallelLinear(
                cfg.intermediate_size, cfg.hidden_size, False, p,
                quant.linear_method(f"{prefix}.mlp.down_proj"), reduce_results=False,
            ),
        }  # fmt: skip
        parts = {"qkv": {"q_proj": "q", "k_proj": "k", "v_proj": "v"},
                 "gate_up": {"gate_proj": 0, "up_proj": 1}, "o": {"o_proj": None},
                 "down": {"down_proj": None}}  # fmt: skip
        for key, layer in layers.items():
            params = dict(layer.named_parameters())
            for part, shard in parts[key].items():
                sub = "self_attn" if key in ("qkv", "o") else "mlp"
                for tname, t in tensors.items():
                    head = f"{prefix}.{sub}.{part}."
                    if tname.startswith(head) and tname[len(head) :] in params:
                        param = params[tname[len(head) :]]
                        param.weight_loader(param, t, shard)
            layer.linear_method.process_weights_after_loading(layer)
        return layers

    full = build(0, 1)
    ranks = [build(r, 2) for r in range(2)]
    x = torch.randn(5, cfg.hidden_size)
    xi = torch.randn(5, cfg.intermediate_size)
    xo = torch.randn(5, cfg.num_heads * cfg.head_dim)
    with torch.no_grad():
        for key, inp in (("qkv", x), ("gate_up", x)):
            want = full[key](inp)
            got = [r[key](inp) for r in ranks]
            sizes = full[key].output_partition_sizes
            want_parts = want.split(sizes, dim=-1)
            got_parts = [
                g.split(r[key].output_partition_sizes, dim=-1)
                for g, r in zip(got, ranks, strict=True)
            ]
            for s in range(len(sizes)):  # each shard (q, k, v / gate, up) split over ranks
                joined = torch.cat([gp[s] for gp in got_parts], dim=-1)
                torch.testing.assert_close(joined, want_parts[s], rtol=1e-5, atol=1e-5)
        for key, inp in (("o", xo), ("down", xi)):
            halves = inp.chunk(2, dim=-1)  # rank r holds inputs [r*K/2, (r+1)*K/2)
            partial = [r[key](h) for r, h in zip(ranks, halves, strict=True)]
            torch.testing.assert_close(sum(partial), full[key](inp), rtol=1e-4, atol=1e-4)
    if name == "gptq-act-order":  # every rank keeps all groups, rows look theirs up
        down = ranks[1]["down"]
        assert down.w4_scales.shape[0] == full["down"].w4_scales.shape[0]
        assert down.w4_g_idx is not None


# ---- unsupported variants --------------------------------------------------------------
def _cfg(llama_ckpt: Path, quant: dict | None) -> ModelConfig:
    cfg = ModelConfig.from_path(llama_ckpt)
    object.__setattr__(cfg, "quantization", quant)
    return cfg


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT_W4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 128},
        }
    },
}  # fmt: skip


def _ct(**weights: object) -> dict:
    raw = json.loads(json.dumps(CT_W4))
    raw["config_groups"]["g"]["weights"].update(weights)
    return raw


@pytest.mark.parametrize(
    "quant,match",
    [
        ({**GPTQ, "bits": 8}, "8-bit weights are not supported"),
        ({**GPTQ, "bits": 3}, "3-bit"),
        ({**AWQ, "bits": 8}, "8-bit weights are not supported"),
        (_ct(num_bits=8), "8-bit int weights are not supported"),
        ({**AWQ, "version": "gemv"}, "GEMM layout only"),
        ({**AWQ, "version": "exllama"}, "'exllama'"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "kernel-specific layout"),
        ({**GPTQ, "is_marlin_format": True}, "Marlin"),
        ({**GPTQ, "lm_head": True}, "quantized lm_head"),
        ({**GPTQ, "dynamic": {"-:.*down": {}}}, "dynamic"),
        ({**AWQ, "modules_to_not_convert": ["visual"]}, r"names \['visual'\]"),
        ({**GPTQ, "modules_to_not_convert": ["lm_head", "vision_tower"]}, "vision_tower"),
        (_ct(strategy="tensor"), "strategy 'tensor'"),
        (
            {
                **CT_W4,
                "config_groups": {
                    "g": {
                        **CT_W4["config_groups"]["g"],
                        "input_activations": {"num_bits": 8, "type": "int"},
                    }
                },
            },
            "W4A8",
        ),
    ],
)
def test_unsupported_variants_are_refused(llama_ckpt: Path, quant: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        get_quantization(_cfg(llama_ckpt, quant), None)


def test_skip_lists_may_not_split_a_fused_layer(llama_ckpt: Path) -> None:
    quant = get_quantization(_cfg(llama_ckpt, {**AWQ, "modules_to_not_convert": ["k_proj"]}), None)
    assert quant is not None
    assert not isinstance(quant.linear_method("model.layers.0.self_attn.o_proj"), Dense)
    with pytest.raises(CheckpointError, match=r"fused layer model\.layers\.0\.self_attn\.qkv"):
        quant.linear_method("model.layers.0.self_attn.qkv_proj")
    quant = get_quantization(_cfg(llama_ckpt, {**AWQ, "modules_to_not_convert": ["mlp"]}), None)
    assert isinstance(quant.linear_method("model.layers.1.mlp.gate_up_proj"), Dense)


def test_quantization_setting_must_match_the_checkpoint(llama_ckpt: Path) -> None:
    assert EngineConfig(quantization="awq").quantization == "awq"
    assert EngineConfig(quantization="gptq").quantization == "gptq"
    with pytest.raises(CheckpointError, match="needs a checkpoint quantized that way"):
        get_quantization(_cfg(llama_ckpt, None), "awq")
    with pytest.raises(CheckpointError, match="does not match the checkpoint's 'awq'"):
        get_quantization(_cfg(llama_ckpt, AWQ), "gptq")
    with pytest.raises(CheckpointError, match="does not match"):
        get_quantization(_cfg(llama_ckpt, CT_W4), "fp8")
    for requested in (None, "auto", "gptq"):
        assert get_quantization(_cfg(llama_ckpt, GPTQ), requested) is not None
    assert get_quantization(_cfg(llama_ckpt, CT_W4), "compressed-tensors") is not None


def test_torch_compile_keeps_the_w4a16_op_opaque(
    int4: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile the W4A16 GEMM is the ``kvscale::w4a16_gemm`` custom op, run
    as is at every step (Inductor compiles around it, never traces the dequantization);
    the compiled model gives the eager tokens."""
    from kvscale.server.quantization import int4 as int4_method

    path = int4("awq-rtn")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in _llm(path).generate(PROMPTS[:4], params)]
    calls = []
    reference = int4_method.w4a16_gemm_ref

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return reference(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(int4_method, "w4a16_gemm_ref", counted)  # the op's CPU body
    compiled = _llm(path, compile=True)
    assert "OptimizedModule" in type(compiled.engine.worker.model.model).__name__
    assert [o.outputs[0].token_ids for o in compiled.generate(PROMPTS[:4], params)] == eager
    assert len(calls) >= 4 * 2 * 4  # 4 linear layers x 2 decoder layers, every step


# ---- tinygemm (PyTorch's CUDA int4 kernel) for up to 4 rows on a GPU ----------------------
@pytest.mark.parametrize("sym", [True, False], ids=["symmetric", "zeros"])
def test_tinygemm_scales_and_codes_give_the_dequantized_product(sym: bool) -> None:
    """The (scale, offset) pairs and the codes read back from our layout, through
    PyTorch's CPU twin of the kernel (same scale/offset format; codes as int32): the
    product of the dequantized weights. The CUDA packing is checked on the GPU
    (``tests/gpu/test_int4_cuda.py``)."""
    from kvscale.kernels.w4a16 import pack_int4_rows, unpack_int4_rows
    from kvscale.server.quantization.int4 import tinygemm_pack, tinygemm_scales

    gen = torch.Generator().manual_seed(0)
    k, n, group = 256, 64, 128
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    zeros = None if sym else torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    z = torch.full_like(scales, 8.0) if zeros is None else zeros.float()
    rows = torch.arange(k) // group
    w = (codes.float() - z[rows]) * scales[rows]  # [K, N]
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    want = x.float() @ w
    back = unpack_int4_rows(pack_int4_rows(codes), k).t()  # [N, K], as finish() reads them
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, tinygemm_pack(back), group, tinygemm_scales(scales, zeros)
    )
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_tinygemm_takes_only_what_its_layout_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscale.server.quantization.int4 import tinygemm_fits, tinygemm_layout_fits

    bf16 = torch.bfloat16
    assert tinygemm_layout_fits(4096, 6144, 128, True, bf16)
    assert not tinygemm_layout_fits(4096, 6144, 128, True, torch.float16)  # bf16 only
    assert not tinygemm_layout_fits(4096, 6144, 128, False, bf16)  # act order
    assert not tinygemm_layout_fits(4096, 6144, 4096, True, bf16)  # per-channel scales
    assert not tinygemm_layout_fits(4096 + 64, 6144, 64, True, bf16)  # K not in 128s
    assert not tinygemm_layout_fits(4096, 6148, 128, True, bf16)  # N not in 8s
    assert not tinygemm_fits(4096, 6144, 128, True, bf16, torch.device("cpu"))
    monkeypatch.setenv("KVSCALE_TINYGEMM", "0")
    assert not tinygemm_fits(4096, 6144, 128, True, bf16, torch.device("cuda"))


def test_tinygemm_copies_stop_at_the_memory_share() -> None:
    from kvscale.server.quantization.int4 import TINYGEMM_MEMORY_SHARE, tinygemm_copy_fits

    total = 80 << 30
    limit = int(TINYGEMM_MEMORY_SHARE * total)
    assert tinygemm_copy_fits(6 << 30, 110 << 20, total)  # the 8B model's largest layer
    assert tinygemm_copy_fits(limit - 100, 100, total)
    assert not tinygemm_copy_fits(limit - 100, 101, total)
    assert not tinygemm_copy_fits(36 << 30, 1, total)  # a 70B 4-bit model on one 80 GB GPU


def test_no_tinygemm_copy_on_the_cpu(int4: Callable[[str], Path]) -> None:
    llm = LLM(str(int4("awq-from-llama-awq-asym")), device="cpu", dtype="bfloat16")
    layer = llm.engine.worker.model.model.layers[0].mlp.down_proj
    assert layer.w4_qweight is not None and layer.w4_tiny is None
