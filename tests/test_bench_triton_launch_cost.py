"""CPU test of bench/triton_launch_cost.py: the direct launch's arguments are the kernel's
parameters in order, defaults applied, launch options left out (the launches themselves
need a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels import rmsnorm
from tests.bench_scripts import load_bench

tlc = load_bench("triton_launch_cost")


def test_bound_values_are_the_kernels_parameters_in_order() -> None:
    x, w, out = torch.zeros(2, 8), torch.ones(8), torch.empty(2, 8)
    args = (x, w, out, 2, 8, 1e-5, 8, 8)
    values = tlc.bound_values(rmsnorm._rms_norm_kernel, args, {"BLOCK": 8, "num_warps": 1})
    assert values[: len(args)] == list(args)
    assert values[len(args) :] == [8]  # BLOCK; num_warps is an option, not a parameter
    with pytest.raises(TypeError):  # a missing parameter is not guessed
        tlc.bound_values(rmsnorm._rms_norm_kernel, args[:-1], {"BLOCK": 8})


def test_main_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tlc.main([])
