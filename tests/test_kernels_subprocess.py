"""Runs tests/kernels in processes of their own under the Triton CPU interpreter.

``TRITON_INTERPRET=1`` has to be set before triton is imported, and the interpreter does not
bounds-check memory, so the kernel tests never run inside the main pytest process. They run
as two processes side by side (the CI machine has two cores, and this test is otherwise
alone on them), each with about half of the interpreter time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ROOT / "tests" / "kernels"
# about half of the interpreter time each (2026-11-28, alone on this machine: these ~70 +
# ~40 s, the others ~95 s; the W4A16 tests are the longest)
FIRST_HALF = (
    "test_w4a16.py",
    "test_elementwise.py",
    "test_fp8_kv.py",
    "test_fp8_gemm.py",
    "test_paged_decode_rope.py",
    "test_ngram_match.py",
)


def test_kernel_tests_pass_under_triton_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_KERNEL_TESTS="1", PYTHONSAFEPATH="1")
    files = sorted(p.name for p in KERNEL_TESTS.glob("test_*.py"))
    halves = [
        [f for f in files if f in FIRST_HALF],
        [f for f in files if f not in FIRST_HALF],
    ]
    assert all(halves), halves
    logs = [tmp_path / f"kernel-tests-{i}.log" for i in range(len(halves))]
    procs = []
    try:
        for half, log in zip(halves, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                        + [f"tests/kernels/{f}" for f in half],
                        cwd=ROOT,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        for proc in procs:
            proc.wait(timeout=1200)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, half, log in zip(procs, halves, logs, strict=True):
        output = log.read_text(errors="replace")
        assert proc.returncode == 0, (
            f"kernel tests {half} failed (rc={proc.returncode}):\n" + output[-20000:]
        )
        assert " passed" in output, output[-5000:]
