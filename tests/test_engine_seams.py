"""The seams of the engine architecture: one configuration, a worker fed plain steps,
typed messages, a KV pool object, sharded linear layers behind linear methods, and one
validation point."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from kvscale.cli import build_parser
from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError, EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.engine.request import validate_request
from kvscale.server.errors import InvalidRequestError
from kvscale.server.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvscale.server.layers.sampler import row_seed
from kvscale.server.parallel import ParallelState
from kvscale.server.process import messages
from kvscale.server.worker.kv_pool import KVPool
from kvscale.server.worker.worker import Worker

PROMPTS = [[1, 415, 2936, 9060, 285], [1, 22, 333, 4444], [1, 7, 8, 9, 10, 11, 12]]


# ---- one configuration ----------------------------------------------------------------
def test_every_cli_setting_is_a_flag_of_serve_and_generate() -> None:
    parser = build_parser()
    for command in (["serve"], ["generate"]):
        args = parser.parse_args(command)
        cfg = EngineConfig.from_args(args)
        for f in fields(EngineConfig):
            if f.metadata["cli"]:
                assert getattr(cfg, f.name) == getattr(EngineConfig(), f.name), f.name
    args = parser.parse_args(["serve", "--max-num-seqs", "7", "--block-size", "32", "--compile"])
    cfg = EngineConfig.from_args(args)
    assert (cfg.max_num_seqs, cfg.block_size, cfg.compile) == (7, 32, True)
    assert cfg.max_num_batched_tokens == 8192  # derived default


def test_flags_cannot_be_abbreviated() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-s", "7"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_seqs": "8"}, "max_num_seqs must be an integer, got '8'"),
        ({"block_size": 3}, "block_size must be one of (8, 16, 32, 64, 128), got 3"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0.0, 1.0]"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "must be >= max_num_seqs (64)"),
        ({"attention_backend": "flash"}, "attention_backend must be one of"),
        ({"quantization": "int8"}, "quantization must be one of"),
        ({"speculative_model": "/draft"}, "are for speculative_method='draft'"),
        ({"speculative_method": "draft"}, "needs speculative_model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 16], got 0"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"dtype": "int8"}, "'int8' is not supported"),
    ],
)
def test_settings_are_validated_with_the_value_and_what_is_allowed(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(model="x", **kwargs)
    assert message in str(e.value)


def test_llm_takes_the_same_settings(llama_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="block_size must be one of"):
        LLM(str(llama_ckpt), device="cpu", block_size=5)
    with pytest.raises(TypeError):
        LLM(str(llama_ckpt), device="cpu", no_such_setting=1)


def test_resolved_config_is_built_once_and_pickles_whole(llama_ckpt: Path) -> None:
    rc, tokenizer = EngineConfig(model=str(llama_ckpt), device="cpu").load()
    assert rc.max_model_len == rc.model.max_position_embeddings
    assert rc.dtype == torch.float32 and rc.device == "cpu"
    assert tokenizer.eos_token_id in rc.eos_token_ids
    assert pickle.loads(pickle.dumps(rc)) == rc


def test_a_quantized_checkpoint_is_refused_not_loaded_as_dense(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = Path(shutil.copytree(llama_ckpt, tmp_path / "fp8"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method='bitsandbytes'"):
        LLM(str(ckpt), device="cpu")


# ---- the worker runs plain, picklable steps -----------------------------------------------
def test_a_second_worker_replaying_the_pickled_steps_samples_the_same_tokens(
    llama_ckpt: Path,
) -> None:
    """What tensor parallelism builds on: the step is all a worker needs, so a worker
    that only ever sees the (pickled) steps computes what the engine's own worker did."""
    eng = LLMEngine(EngineConfig(model=str(llama_ckpt), device="cpu", num_kv_blocks=64))
    replica = Worker(eng.config)
    steps: list[bytes] = []
    pendings: list[Any] = []
    launch = eng.worker.launch

    def recording_launch(step: Any) -> Any:
        steps.append(pickle.dumps(step))
        pendings.append(launch(step))
        return pendings[-1]

    eng.worker.launch = recording_launch  # type: ignore[method-assign]
    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, presence_penalty=0.5),
    ]
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    while eng.has_unfinished_requests():
        eng.step()
    engine_tokens = [p.result().token_ids for p in pendings]
    replica_tokens = [replica.launch(pickle.loads(b)).result().token_ids for b in steps]
    assert len(steps) >= 8 and replica_tokens == engine_tokens


def test_each_worker_keeps_its_operator_routing_when_another_engine_changes_it(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers' operators are routed process-wide (``ops.use_kernels``); a CUDA engine
    with the Triton backend built after a CPU one routes them to the kernels, which then
    got the CPU engine's tensors ("Pointer argument ... cannot be accessed from Triton
    (cpu tensor?)"). Every step runs under its own worker's routing."""
    from kvscale.kernels import activation, argmax, rmsnorm, rotary, w4a16
    from kvscale.server.layers import ops

    llm = LLM(str(llama_ckpt), device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, logit_bias={77: 9.0})
    want = llm.generate(PROMPTS, params)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a CPU engine's step reached a Triton kernel")

    for module, name in [
        (rmsnorm, "rms_norm"),
        (rmsnorm, "fused_add_rms_norm"),
        (activation, "silu_and_mul"),
        (rotary, "rotary_embedding"),
        (w4a16, "w4a16_gemm"),
        (argmax, "argmax"),
    ]:
        monkeypatch.setattr(module, name, kernel)
    ops.use_kernels(True)  # what building a CUDA engine with the triton backend does
    try:
        got = llm.generate(PROMPTS, params)
        assert ops.rms_norm is kernel  # the other engine's routing is left as it was
    finally:
        ops.use_kernels(False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs


def test_row_seeds_depend_on_seed_and_index_only() -> None:
    seeds = {row_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)
    assert row_seed(7, 3) == row_seed(7, 3) != row_seed(3, 7)


# ---- typed messages -------------------------------------------------------------------------
def test_messages_pickle_and_match_by_class() -> None:
    msg = messages.AddRequest("r", [1, 2], SamplingParams(n=2), 1.5)
    back = pickle.loads(pickle.dumps(msg))
    assert back == msg
    match back:
        case messages.AddRequest(rid, ids, params, _):
            assert (rid, ids, params.n) == ("r", [1, 2], 2)
        case _:
            raise AssertionError("no match")


# ---- the KV pool -------------------------------------------------------------------------
def test_kv_pool_allocates_binds_and_counts_bytes() -> None:
    pool = KVPool(3, 2, 8, 16, torch.float16, torch.device("cpu"))
    assert pool.bytes_per_block == 2 * 16 * 2 * 8 * 3 * 2
    pool.allocate(5)
    assert pool.nbytes == 5 * pool.bytes_per_block
    layer = pool.layers[1]
    assert layer.k.shape == (5, 16, 2, 8) and layer.v.dtype == torch.float16
    assert float(layer.k_scale) == 1.0

    class Attn:
        kv = None
        num_kv_heads = 2
        head_dim = 8

    attn = [Attn(), Attn(), Attn()]
    pool.bind(attn)
    assert attn[2].kv is pool.layers[2]
    bad = Attn()
    bad.num_kv_heads = 4
    with pytest.raises(ValueError, match="4 KV heads"):
        pool.bind([Attn(), bad, Attn()])


# ---- sharded linear layers (loaded per rank, no process group needed to load) -----------------
def _shards(make: Any, load: Any, world: int = 2) -> list[Any]:
    layers = []
    for rank in range(world):
        layer = make(ParallelState(rank, world))
        load(layer)
        layers.append(layer)
    return layers


def test_column_qkv_and_row_shards_recompose_the_full_layers() -> None:
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads, inter = 16, 4, 4, 2, 12
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    qkv = _shards(
        lambda p: QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, p),
        lambda layer: [
            layer.weight_loader(layer.weight, t, s) for t, s in zip((q, k, v), "qkv", strict=True)
        ],
    )
    x = torch.randn(3, hidden)
    outs = [layer(x).split([2 * head_dim, head_dim, head_dim], dim=-1) for layer in qkv]
    for i, full in enumerate((q, k, v)):
        torch.testing.assert_close(torch.cat([o[i] for o in outs], -1), x @ full.T)

    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    merged = _shards(
        lambda p: MergedColumnParallelLinear(hidden, [inter, inter], False, p),
        lambda layer: [layer.weight_loader(layer.weight, t, i) for i, t in enumerate((gate, up))],
    )
    halves = [layer(x).chunk(2, dim=-1) for layer in merged]
    torch.testing.assert_close(torch.cat([h[0] for h in halves], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([h[1] for h in halves], -1), x @ up.T)

    down, bias = torch.randn(hidden, inter), torch.randn(hidden)

    def load_row(layer: RowParallelLinear) -> None:
        layer.weight_loader(layer.weight, down)
        layer.weight_loader(layer.bias, bias)

    rows = _shards(lambda p: RowParallelLinear(inter, hidden, True, p), load_row)
    h = torch.randn(3, inter)
    parts = [
        layer.linear_method.apply(layer, h.chunk(2, -1)[r], None) for r, layer in enumerate(rows)
    ]
    torch.testing.assert_close(sum(parts) + bias, h @ down.T + bias)
    assert rows[0].weight.output_dim == 0 and rows[0].weight.input_dim == 1


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    hidden, head_dim = 8, 2
    k = torch.randn(1 * head_dim, hidden)
    layers = _shards(
        lambda p: QKVParallelLinear(hidden, head_dim, 2, 1, False, p),
        lambda layer: layer.weight_loader(layer.weight, k, "k"),
    )
    for layer in layers:
        assert layer.num_kv_heads == 1
        torch.testing.assert_close(layer.weight[head_dim : 2 * head_dim], k)


# ---- one validation point -------------------------------------------------------------------
def test_validation_names_the_field_and_the_reason() -> None:
    with pytest.raises(InvalidRequestError) as e:
        validate_request([1] * 10, SamplingParams(), vocab_size=100, max_model_len=10)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError) as e:
        validate_request([1, 200], SamplingParams(), vocab_size=100, max_model_len=10)
    assert e.value.param == "prompt" and "[200]" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        validate_request([1], SamplingParams(stop_token_ids=[100]), 100, 10)
    assert e.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=0)
    assert e.value.param == "top_p"


def test_cublaslt_only_for_small_decode_graphs_on_cuda_and_never_against_a_user_s_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode graphs of up to 64 rows capture cuBLASLt's GEMMs on NVIDIA CUDA (NOTES e66);
    larger ones, the CPU, and a process where a user set one of PyTorch's BLAS switches
    keep the process's choice, which the capture block leaves as it found it."""
    from kvscale.server.quantization import dense

    for key in dense.BLAS_ENV:
        monkeypatch.delenv(key, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    limit = dense.CUBLASLT_MAX_ROWS
    assert limit == 64
    assert dense.capture_with_cublaslt(cuda, 1) and dense.capture_with_cublaslt(cuda, limit)
    assert not dense.capture_with_cublaslt(cuda, limit + 1)
    assert not dense.capture_with_cublaslt(cpu, 1)
    for key, value in zip(dense.BLAS_ENV, ("0", ":4096:8", "1024"), strict=True):
        monkeypatch.setenv(key, value)
        assert not dense.capture_with_cublaslt(cuda, 1)
        monkeypatch.delenv(key)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not dense.capture_with_cublaslt(cuda, 1)
    monkeypatch.undo()
    before = torch.backends.cuda.preferred_blas_library()
    with dense.blas_for_capture(cpu, 1), dense.blas_for_capture(cuda, limit + 1):
        assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before
