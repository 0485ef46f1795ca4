"""Kernel tests: collected only when ``KVSCALE_KERNEL_TESTS=1``.

In the main test run they are skipped here and executed by
``tests/test_kernels_subprocess.py`` in a separate process under the Triton CPU interpreter
(``TRITON_INTERPRET=1`` must be set before triton is imported). On a GPU machine run them
natively (adds bf16 and GPU-only cases)::

    KVSCALE_KERNEL_TESTS=1 python -m pytest tests/kernels -q
"""

from __future__ import annotations

import os

import pytest

ENABLED = os.environ.get("KVSCALE_KERNEL_TESTS") == "1"

if not ENABLED:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def device() -> object:
    from kvscale.kernels.testing import default_device

    return default_device()


@pytest.fixture(autouse=True)
def _seed() -> None:
    import torch

    torch.manual_seed(1234)
