"""Runs tests/kernels in its own process under the Triton CPU interpreter.

``TRITON_INTERPRET=1`` has to be set before triton is imported, and the interpreter does not
bounds-check memory, so the kernel tests never run inside the main pytest process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_tests_pass_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_KERNEL_TESTS="1", PYTHONSAFEPATH="1")
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"kernel tests failed (rc={proc.returncode}):\n{output[-20000:]}"
    assert " passed" in proc.stdout, output[-5000:]
