"""The batch limits an engine picks when ``max_num_seqs``/``cuda_graph_max_batch`` are
left unset: 1,024 sequences with decode graphs to 1,024 rows on GPUs of at least 70 GiB
(bench/NOTES.md "e83 measured", "e84 measured"), 256 and 256 elsewhere and with
speculative decoding; the graphs' default never above ``max_num_seqs``."""

from __future__ import annotations

import pytest
import torch

from kvscale.cli import build_parser
from kvscale.server import config as config_mod
from kvscale.server.config import (
    DEFAULT_BATCH,
    LARGE_GPU_BATCH,
    EngineConfig,
    default_batch_limits,
    smallest_gpu_bytes,
)

GIB = 2**30


@pytest.mark.parametrize(
    ("gpu_bytes", "speculative", "limits"),
    [
        (None, False, (256, 256)),  # CPU
        (24 * GIB, False, (256, 256)),
        (70 * GIB - 1, False, (256, 256)),
        (70 * GIB, False, (1024, 1024)),
        (80 * GIB, False, (1024, 1024)),
        (141 * GIB, False, (1024, 1024)),
        (80 * GIB, True, (256, 256)),
    ],
)
def test_default_batch_limits(
    gpu_bytes: int | None, speculative: bool, limits: tuple[int, int]
) -> None:
    assert default_batch_limits(gpu_bytes, speculative) == limits


def test_no_gpu_means_the_small_defaults() -> None:
    for device in ("cpu", "cuda:x"):
        assert smallest_gpu_bytes(device, 1) is None, device
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_batch_defaults_cuda.py checks its size")
    for device in ("auto", "cuda", "cuda:0"):
        assert smallest_gpu_bytes(device, 1) is None, device
    cfg = EngineConfig()
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_batch) == DEFAULT_BATCH
    assert cfg.max_num_batched_tokens == 8192


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The engine's GPU query answering as on one 80 GB H100 (this machine has none);
    records what it was asked."""
    asked: list[tuple[str, int]] = []

    def query(device: str, tp: int) -> int:
        asked.append((device, tp))
        return 81_559 * 2**20  # nvidia-smi's total on r91's H100

    monkeypatch.setattr(config_mod, "smallest_gpu_bytes", query)
    return asked


def test_a_large_gpu_gets_the_large_batch(h100: list[tuple[str, int]]) -> None:
    cfg = EngineConfig(device="cuda", tensor_parallel_size=2)
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_batch) == LARGE_GPU_BATCH
    assert cfg.max_num_batched_tokens == 8192
    assert h100 == [("cuda", 2)]


def test_set_values_win_and_the_token_budget_caps_the_default(
    h100: list[tuple[str, int]],
) -> None:
    cfg = EngineConfig(max_num_seqs=64, cuda_graph_max_batch=0)
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_batch) == (64, 0)
    assert h100 == []  # nothing left to default: no GPU query
    cfg = EngineConfig(max_num_seqs=64)
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_batch) == (64, 64)
    cfg = EngineConfig(max_num_seqs=2048, max_num_batched_tokens=8192)
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_batch) == (2048, 1024)
    cfg = EngineConfig(max_num_batched_tokens=600)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.cuda_graph_max_batch) == (
        600,
        600,
        600,
    )
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(600\) must be >= "):
        EngineConfig(max_num_seqs=1024, max_num_batched_tokens=600)


def test_speculation_keeps_the_small_batch(h100: list[tuple[str, int]]) -> None:
    cfg = EngineConfig(speculative_method="ngram")
    assert (cfg.max_num_seqs, cfg.cuda_graph_max_batch) == DEFAULT_BATCH


def test_the_draft_sidecar_defaults_to_the_targets_batch_under_speculation() -> None:
    ns = build_parser().parse_args(["serve-draft", "--model", "demo", "--socket", "/tmp/s"])
    assert ns.max_num_seqs == DEFAULT_BATCH[0]
    ns = build_parser().parse_args(["serve"])
    assert ns.max_num_seqs is None and ns.cuda_graph_max_batch is None
