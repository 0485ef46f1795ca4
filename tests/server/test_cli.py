"""``kvscale --help`` / ``serve --help`` document every flag; features that do not exist
yet are refused at start with exit code 2; a bad checkpoint exits 1 with its reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvscale.cli import build_parser, main

from .conftest import server_env

SERVE_FLAGS = [
    "--model", "--tokenizer", "--served-model-name", "--dtype", "--max-model-len",
    "--chat-template", "--device", "--max-num-seqs", "--max-num-batched-tokens",
    "--block-size", "--num-kv-blocks", "--gpu-memory-utilization", "--attention-backend",
    "--seed", "--host", "--port", "--api-key", "--max-queue-len", "--drain-timeout",
    "--no-warmup", "--log-level", "--disable-access-log", "--enable-prefix-caching",
    "--quantization", "--speculative-method", "--speculative-model", "--num-speculative-tokens",
    "--speculative-placement", "--ngram-min", "--ngram-max", "--speculative-disable-by-batch-size",
    "--tensor-parallel-size", "--kv-cache-dtype", "--watchdog-timeout",
]  # fmt: skip
BENCH_FLAGS = [
    "--base-url", "--model", "--api-key", "--dataset", "--num-prompts", "--request-rate",
    "--max-concurrency", "--input-len", "--output-len", "--range-ratio", "--seed",
    "--result-file", "--timeout", "--disable-tqdm",
]  # fmt: skip


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    top = _help([], capsys)
    for cmd in ("serve", "bench", "generate"):
        assert cmd in top
    serve = _help(["serve"], capsys)
    for flag in SERVE_FLAGS:
        assert flag in serve, flag
    assert "/v1/chat/completions" in serve and "SIGTERM" in serve
    bench = _help(["bench", "serve"], capsys)
    for flag in BENCH_FLAGS:
        assert flag in bench, flag
    assert "sharegpt-like" in bench


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quantization", "int4"], "quantization must be one of"),
        (["--speculative-model", "/m"], "are for speculative_method='draft'"),
        (["--speculative-method", "draft"], "needs speculative_model"),
        (["--speculative-method", "eagle"], "speculative_method must be one of"),
        (["--num-speculative-tokens", "17"], "num_speculative_tokens must be in [1, 16]"),
        (["--ngram-min", "5"], "ngram_min=5 must be <= ngram_max=4"),
        (
            [
                "--speculative-method",
                "draft",
                "--speculative-model",
                "/d",
                "--speculative-placement",
                "sidecar",
            ],
            "a sidecar is reached at unix:///",
        ),
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
        (["--tensor-parallel-size", "2", "--device", "cuda:1"], "rank r runs on GPU r"),
        (["--watchdog-timeout", "0"], "watchdog_timeout must be"),
        (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype must be one of"),
        (["--block-size", "7"], "block_size must be one of"),
        (["--max-queue-len", "0"], "--max-queue-len must be >= 1"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
        (["--device", "tpu"], "device must be"),
    ],
)
def test_unsupported_or_bad_flags_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nowhere", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "kvscale serve: error:" in err and message in err, err


def test_speculative_flags_are_accepted() -> None:
    from kvscale.server.api.launcher import check_flags

    for extra in (
        ["--speculative-method", "ngram", "--ngram-min", "1", "--ngram-max", "3"],
        ["--speculative-method", "draft", "--speculative-model", "unix:///run/d.sock"],
        [
            "--speculative-method",
            "draft",
            "--speculative-model",
            "/d",
            "--num-speculative-tokens",
            "2",
        ],
    ):
        check_flags(build_parser().parse_args(["serve", "--quantization", "none", *extra]))


def test_a_bad_checkpoint_exits_1_with_its_reason(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale.cli", "serve", "--model", str(tmp_path / "missing"),
         "--host", "127.0.0.1", "--port", "0", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=server_env(),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "start-up failed" in proc.stderr and "is not a directory" in proc.stderr
