"""Tensor parallelism on the CPU: two ranks in two processes over gloo.

Greedy tokens of TP=2 equal TP=1's (fp32) for Llama with 2 KV heads (one per rank) and
with 1 KV head (replicated on both ranks), and for Qwen2 (q/k/v biases, tied
embeddings), both with a vocabulary that does not divide by 2 (padded, padding never
sampled), under forced chunked prefill and preemption. Each rank reads only its slices
of the checkpoint (bytes counted per tensor), for dense, FP8 and packed weights. A rank
that hangs fails the engine within ``watchdog_timeout`` with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from kvscale.server import LLM, SamplingParams
from kvscale.server.config import CheckpointError, EngineConfig, ModelConfig, check_tensor_parallel
from kvscale.server.distributed import TensorParallelError
from kvscale.server.distributed.group import check_gpus, rank_env
from kvscale.server.layers.embedding import ParallelLMHead
from kvscale.server.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvscale.server.models.loader import iter_tensors, load_model
from kvscale.server.parallel import SINGLE, ParallelState, padded_vocab_size
from kvscale.server.quantization import LinearMethod, set_weight_attrs
from tests.hf_reference import fp8_tp2_and_quantization_gaps, random_prompts

ODD_VOCAB = 31999
PROMPTS = [[t % ODD_VOCAB for t in p] for p in random_prompts(12, (2, 70), seed=5)]
MAX_NEW = 10
# chunked prefill (16 tokens a step) and preemption (14 blocks of 8 tokens) in one run
FORCED = dict(max_num_batched_tokens=16, max_num_seqs=16, num_kv_blocks=14, max_model_len=96,
              block_size=8)  # fmt: skip

ARCHES: dict[str, dict[str, Any]] = {
    # 4 heads, 2 KV heads: each rank holds 2 query heads and 1 KV head
    "llama": dict(arch="llama"),
    # 1 KV head: replicated on both ranks; vocabulary padded to 32,000; biases on every
    # projection (row-parallel biases are added once, after the all-reduce)
    "llama-mqa-odd-vocab": dict(
        arch="llama",
        seed=4,
        num_key_value_heads=1,
        vocab_size=ODD_VOCAB,
        attention_bias=True,
        mlp_bias=True,
    ),
    # q/k/v biases, tied (and padded) embeddings
    "qwen2-odd-vocab": dict(arch="qwen2", seed=2, vocab_size=ODD_VOCAB),
}


@pytest.fixture(scope="module")
def ckpts(checkpoint_factory: Callable[..., Path]) -> dict[str, Path]:
    return {name: checkpoint_factory(name, **kw) for name, kw in ARCHES.items()}


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# rank 0 samples for everyone: seeded draws, penalties and logprobs give TP=1's results
OTHERS = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2, seed=3,
                   max_tokens=MAX_NEW, ignore_eos=True, logprobs=2),
]  # fmt: skip
PARAMS = [GREEDY] * (len(PROMPTS) - len(OTHERS)) + OTHERS


def _tp1_reference(path: Path) -> list[Any]:
    """TP=1's outputs, on one thread as each of the two ranks runs (the same arithmetic
    as the default; two busy OpenMP threads on a shared 2-core machine crawl)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = LLM(str(path), device="cpu", **FORCED).generate(PROMPTS, PARAMS)
    finally:
        torch.set_num_threads(threads)
    return [o.outputs[0] for o in outs]


def _tp_llm(path: Path, **kw: Any) -> LLM:
    return LLM(str(path), device="cpu", tensor_parallel_size=2, **kw)


@pytest.mark.parametrize("arch", list(ARCHES))
def test_tp2_tokens_equal_tp1(ckpts: dict[str, Path], arch: str) -> None:
    path = ckpts[arch]
    ref = _tp1_reference(path)
    llm = _tp_llm(path, **FORCED)
    try:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
        eng = llm.engine
        assert eng.stats().num_preemptions > 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        llm.engine.core.shutdown()
    assert max(len(p) for p in PROMPTS) > 16  # prompts were split into chunks
    got, want = [o.token_ids for o in outs], [o.token_ids for o in ref]
    bad = [i for i, (g, r) in enumerate(zip(got, want, strict=True)) if g != r]
    assert not bad, f"prompts {bad} differ: {got[bad[0]]} vs {want[bad[0]]}"
    assert all(t < ODD_VOCAB for toks in got for t in toks)  # padding never sampled
    for a, b in zip(outs[-1].logprobs or [], ref[-1].logprobs or [], strict=True):
        assert a.keys() == b.keys()
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)
            assert a[tok].rank == b[tok].rank
    assert outs[-1].logprobs


@pytest.mark.parametrize(
    "spec",
    [
        dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
        dict(speculative_method="draft", num_speculative_tokens=3),  # the target as its draft
    ],
    ids=["ngram", "draft-inprocess"],
)
def test_tp2_with_speculation_gives_tp1s_greedy_tokens(
    ckpts: dict[str, Path], spec: dict[str, Any]
) -> None:
    """Speculative steps at TP=2 (rank 0 drafts and verifies; the other rank runs the
    multi-token verify forward from the host arrays it is sent): greedy tokens equal TP=1
    without speculation, under chunked prefill and preemption. With the target as its own
    draft every draft is accepted."""
    path = ckpts["llama"]
    prompts = [p[:30] * 2 for p in PROMPTS]  # each repeats itself: n-gram lookups match
    greedy = [GREEDY] * len(prompts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [o.outputs[0].token_ids for o in
                LLM(str(path), device="cpu", **FORCED).generate(prompts, greedy)]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    if spec["speculative_method"] == "draft":
        spec = {**spec, "speculative_model": str(path)}
    llm = _tp_llm(path, **FORCED, **spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        stats = llm.engine.stats()
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.engine.core.shutdown()
    bad = [i for i, (g, r) in enumerate(zip(got, want, strict=True)) if g != r]
    assert not bad, f"prompts {bad} differ: {got[bad[0]]} vs {want[bad[0]]}"
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0
    if spec["speculative_method"] == "draft":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


WATCHDOG_S = 5.0  # a real step of the tiny model takes milliseconds, even on a busy machine


def test_a_hung_rank_fails_the_engine_within_the_watchdog_timeout(ckpts: dict[str, Path]) -> None:
    llm = _tp_llm(ckpts["llama"], num_kv_blocks=32, max_model_len=128, watchdog_timeout=WATCHDOG_S)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        assert len(llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids) == 4
        (pid,) = llm.engine.worker.rank_pids
        os.kill(pid, signal.SIGSTOP)  # rank 1 stops answering: rank 0 waits in a collective
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as e:
            llm.generate([PROMPTS[1]], params)
        waited = time.monotonic() - t0
        assert f"rank 1 (pid {pid}) is stopped" in str(e.value)
        assert "watchdog_timeout" in str(e.value)
        assert WATCHDOG_S <= waited < WATCHDOG_S + 15.0
        with pytest.raises(TensorParallelError, match="rank 1"):  # the engine stays failed
            llm.generate([PROMPTS[1]], params)
    finally:
        llm.engine.core.shutdown()


def _children() -> set[int]:
    """This process's live child processes (Linux)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


def test_a_checkpoint_that_cannot_load_stops_every_rank(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    broken = Path(shutil.copytree(ckpts["llama"], tmp_path / "broken"))
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    before = _children()
    with pytest.raises((CheckpointError, TensorParallelError), match="missing tensors"):
        _tp_llm(broken, num_kv_blocks=32, max_model_len=128)
    assert _children() == before  # rank 1 was stopped and reaped


# ---- each rank reads only its slices ------------------------------------------------
def _expected_share(name: str, full: int, rank: int, cfg: ModelConfig) -> int:
    """Bytes rank ``rank`` of 2 must read of tensor ``name`` (``full`` bytes)."""
    if "norm" in name:
        return full  # replicated
    if ("k_proj" in name or "v_proj" in name) and cfg.num_kv_heads < 2:
        return full  # one KV head, replicated on both ranks
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return full  # a row-parallel layer's bias is added once, after the sum
    if "embed_tokens" in name or name == "lm_head.weight":
        row = full // cfg.vocab_size
        per_rank = padded_vocab_size(cfg.vocab_size, 2) // 2
        return row * min(per_rank, cfg.vocab_size - rank * per_rank)
    return full // 2  # split by output rows (q/k/v, gate/up) or input columns (o, down)


@pytest.mark.parametrize("arch", ["llama", "llama-mqa-odd-vocab"])
def test_each_rank_reads_only_its_slices(ckpts: dict[str, Path], arch: str) -> None:
    path = ckpts[arch]
    cfg = ModelConfig.from_path(path)
    full_reads: dict[str, int] = {}
    full = load_model(cfg, path, torch.float32, torch.device("cpu"), SINGLE, reads=full_reads)
    sd = full.state_dict()
    for rank in (0, 1):
        reads: dict[str, int] = {}
        # no process group is needed to load a rank's shard
        shard = load_model(
            cfg, path, torch.float32, torch.device("cpu"), ParallelState(rank, 2), reads=reads
        )
        assert set(reads) == set(full_reads)
        for name, nbytes in full_reads.items():
            assert reads[name] == _expected_share(name, nbytes, rank, cfg), name
        # what was read is this rank's part of each layer
        part = shard.state_dict()
        d = cfg.head_dim
        q = cfg.num_heads * d // 2
        kv = max(1, cfg.num_kv_heads // 2) * d
        kv_rank = rank if cfg.num_kv_heads >= 2 else 0
        qkv = sd["model.layers.0.self_attn.qkv_proj.weight"]
        full_q, full_k, full_v = qkv.split([cfg.num_heads * d] + [cfg.num_kv_heads * d] * 2)
        torch.testing.assert_close(
            part["model.layers.0.self_attn.qkv_proj.weight"],
            torch.cat([full_q[rank * q : (rank + 1) * q], full_k[kv_rank * kv : (kv_rank + 1) * kv],
                       full_v[kv_rank * kv : (kv_rank + 1) * kv]]),
        )  # fmt: skip
        h = cfg.intermediate_size // 2
        torch.testing.assert_close(
            part["model.layers.1.mlp.down_proj.weight"],
            sd["model.layers.1.mlp.down_proj.weight"][:, rank * h : (rank + 1) * h],
        )
        per_rank = padded_vocab_size(cfg.vocab_size, 2) // 2
        emb = part["model.embed_tokens.weight"]
        n = min(per_rank, cfg.vocab_size - rank * per_rank)
        torch.testing.assert_close(emb[:n], sd["model.embed_tokens.weight"][rank * per_rank :][:n])
        assert not emb[n:].any()  # padding rows


def test_fp8_ranks_read_their_slices_and_scales(
    checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from .quantized_checkpoints import compress

    src = checkpoint_factory("llama", arch="llama")
    path = compress(src, tmp_path_factory.mktemp("tp-fp8") / "ckpt", "FP8_DYNAMIC")
    cfg = ModelConfig.from_path(path)
    from kvscale.server.quantization import get_quantization

    quant = get_quantization(cfg, None)
    full_reads: dict[str, int] = {}
    dev = torch.device("cpu")
    sd = load_model(cfg, path, torch.float32, dev, SINGLE, quant, full_reads).state_dict()
    inter = cfg.intermediate_size // 2
    for rank in (0, 1):
        reads: dict[str, int] = {}
        part = load_model(cfg, path, torch.float32, dev, ParallelState(rank, 2), quant, reads)
        part_sd = part.state_dict()
        for name, nbytes in full_reads.items():
            if name.endswith("weight_scale") and ("o_proj" in name or "down_proj" in name):
                assert reads[name] == nbytes, name  # per output channel: not split by rows
            elif name.endswith("weight_scale"):
                assert reads[name] == nbytes // 2, name  # this rank's output channels
            else:
                assert reads[name] == _expected_share(name, nbytes, rank, cfg), name
        layer = "model.layers.0.mlp."
        w = part_sd[layer + "down_proj.weight"]
        assert w.dtype == torch.float8_e4m3fn
        assert torch.equal(
            w.view(torch.uint8),
            sd[layer + "down_proj.weight"][:, rank * inter : (rank + 1) * inter].view(torch.uint8),
        )
        gate_up = sd[layer + "gate_up_proj.weight_scale"]
        torch.testing.assert_close(
            part_sd[layer + "gate_up_proj.weight_scale"],
            torch.cat([gate_up[rank * inter : (rank + 1) * inter],
                       gate_up[(2 + rank) * inter : (3 + rank) * inter]]),
        )  # fmt: skip


class _PackedStorage(LinearMethod):
    """Stores a layer as int4 quantizers do (8 values per int32, group scales), packed
    along the input (compressed-tensors) or the output dimension (AWQ); ``apply`` is not
    needed to test loading."""

    def __init__(self, packed: str, group: int = 8) -> None:
        self.packed = packed
        self.group = group

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        if self.packed == "input":  # [out, in / 8]
            w = torch.empty(out_features, in_features // 8, dtype=torch.int32)
            attrs = dict(output_dim=0, input_dim=1, packed_dim=1, pack_factor=8)
        else:  # [in, out / 8]
            w = torch.empty(in_features, out_features // 8, dtype=torch.int32)
            attrs = dict(output_dim=1, input_dim=0, packed_dim=1, pack_factor=8)
        layer.register_parameter(
            "qweight", set_weight_attrs(nn.Parameter(w, requires_grad=False), **attrs)
        )
        s = torch.empty(out_features, in_features // self.group)
        layer.register_parameter(
            "scales",
            set_weight_attrs(nn.Parameter(s, requires_grad=False), output_dim=0, input_dim=1),
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


def test_checkpoint_tensors_read_only_what_is_used(tmp_path: Path) -> None:
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    save_file({"w": w, "s": torch.tensor(2.0)}, str(tmp_path / "model.safetensors"))
    reads: dict[str, int] = {}
    t = dict(iter_tensors(tmp_path, reads))
    lazy = t["w"][2:4, 1:5]  # slicing and narrowing read nothing
    assert lazy.shape == (2, 4) and len(lazy) == 2 and not reads
    assert torch.equal(lazy.narrow(1, 1, 2).read(), w[2:4, 2:4]) and reads == {"w": 16}
    dst = torch.zeros(2, 4)
    dst.copy_(lazy)  # a torch function reads what it is given
    assert torch.equal(dst, w[2:4, 1:5]) and reads == {"w": 16 + 32}
    assert torch.equal(lazy * 2, w[2:4, 1:5] * 2) and float(t["s"]) == 2.0
    assert torch.equal(t["w"][[0, 5]], w[[0, 5]])  # fancy indexing reads, then indexes
    with pytest.raises(ValueError, match="cannot take"):
        t["w"].narrow(0, 4, 3)


@pytest.mark.parametrize("packed", ["input", "output"])
def test_packed_weights_are_read_in_stored_units(tmp_path: Path, packed: str) -> None:
    """The slice reading follows ``packed_dim``/``pack_factor``, whatever the format."""
    n_in, n_out = 64, 32
    g = torch.Generator().manual_seed(0)
    if packed == "input":
        qweight = torch.randint(
            -(2**31), 2**31 - 1, (n_out, n_in // 8), generator=g, dtype=torch.int32
        )
    else:
        qweight = torch.randint(
            -(2**31), 2**31 - 1, (n_in, n_out // 8), generator=g, dtype=torch.int32
        )
    scales = torch.randn(n_out, n_in // 8, generator=g)
    save_file({"col.qweight": qweight, "col.scales": scales, "row.qweight": qweight.clone(),
               "row.scales": scales.clone()}, str(tmp_path / "model.safetensors"))  # fmt: skip
    for rank in (0, 1):
        p = ParallelState(rank, 2)
        layers = {
            "col": ColumnParallelLinear(n_in, n_out, False, p, _PackedStorage(packed)),
            "row": RowParallelLinear(n_in, n_out, False, p, _PackedStorage(packed)),
        }
        reads: dict[str, int] = {}
        for name, t in iter_tensors(tmp_path, reads):
            layer, param = name.split(".")
            getattr(layers[layer], param).weight_loader(getattr(layers[layer], param), t)
        assert reads == {name: t.nbytes // 2 for name, t in
                         (("col.qweight", qweight), ("col.scales", scales),
                          ("row.qweight", qweight), ("row.scales", scales))}  # fmt: skip
        out_dim = 0 if packed == "input" else 1
        in_dim = 1 - out_dim
        col, row = layers["col"], layers["row"]
        torch.testing.assert_close(col.qweight, qweight.chunk(2, out_dim)[rank])
        torch.testing.assert_close(row.qweight, qweight.chunk(2, in_dim)[rank])
        torch.testing.assert_close(col.scales, scales.chunk(2, 0)[rank])
        torch.testing.assert_close(row.scales, scales.chunk(2, 1)[rank])


def test_other_ranks_get_steps_without_the_samplers_arrays() -> None:
    from kvscale.server.distributed.driver import step_for_other_ranks
    from kvscale.server.worker.step import profile_step

    step = profile_step(20, 8)
    step.arrays["prompt_ids"] = np.zeros((1, 4096), dtype=np.int64)
    slim = step_for_other_ranks(step)
    assert set(slim.arrays) == set(step.arrays) - {"sampling", "prompt_ids"}
    assert slim.sampling.num_rows == step.sampling.num_rows == 1
    assert (slim.num_seqs, slim.max_query_len, slim.graph_size) == (1, 20, 0)
    assert "prompt_ids" in step.arrays  # rank 0's own step is untouched


# ---- vocabulary padding, settings and start-up checks --------------------------------
def test_vocabulary_padding() -> None:
    assert padded_vocab_size(31999, 1) == 31999
    assert padded_vocab_size(31999, 2) == 32000
    assert padded_vocab_size(128256, 2) == 128256  # Llama 3: 64,128 rows per rank
    assert padded_vocab_size(128256, 8) == 128512  # 16,064 rows per rank (64 | 16,064)
    assert padded_vocab_size(151936, 4) % (64 * 4) == 0
    head = ParallelLMHead(ODD_VOCAB, 8, ParallelState(1, 2))
    assert head.per_rank == 16000 and head.valid_per_rank == [16000, 15999]
    assert (head.vocab_start, head.vocab_end) == (16000, ODD_VOCAB)


def test_settings_and_start_up_checks(ckpts: dict[str, Path]) -> None:
    path = str(ckpts["llama"])  # 4 heads, 2 KV heads, intermediate 512
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by it"):
        EngineConfig(model=path, device="cpu", tensor_parallel_size=3).resolve()
    cfg = ModelConfig.from_path(path)
    check_tensor_parallel(cfg, 4)  # 2 KV heads on 4 ranks: each replicated twice
    with pytest.raises(ValueError, match="num_key_value_heads=3 neither divides by it"):
        check_tensor_parallel(replace(cfg, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate_size=510 is not divisible"):
        check_tensor_parallel(replace(cfg, intermediate_size=510), 4)
    with pytest.raises(ValueError, match="rank r runs on GPU r"):
        EngineConfig(model=path, device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match="needs 2 GPUs on this node, one per rank, but 1 is visible"
    ):
        check_gpus(2, 1)
    check_gpus(2, 4)
    env = rank_env({"NCCL_NVLS_ENABLE": "1"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    with pytest.raises(ValueError, match="watchdog_timeout must be"):
        EngineConfig(model=path, watchdog_timeout=0)


def test_fp8_at_load_tp2_stays_within_the_quantization_error(
    checkpoint_factory: Callable[..., Path],
) -> None:
    """Each rank quantizes its half of a row-parallel input per token, so FP8 TP=2 is not
    FP8 TP=1 bit for bit; it must be as close to it as FP8 is to bf16."""
    path = checkpoint_factory("tp-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    tp_gap, quant_gap = fp8_tp2_and_quantization_gaps(
        path, PROMPTS, device="cpu", num_kv_blocks=64, max_model_len=96
    )
    assert 0 < tp_gap <= quant_gap
