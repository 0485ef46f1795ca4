"""Programmatic dependent launch (``kernels/pdl.py``): where it is off, and the kernels'
wait compiled for sm_90 here (no GPU needed) before what the rule says it must precede.
The GPU run of the same kernels with and without PDL is ``tests/gpu/test_pdl_cuda.py``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvscale.kernels import pdl

WAIT = "griddepcontrol.wait"
RELEASE = "griddepcontrol.launch_dependents"


@pytest.fixture
def env_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    yield monkeypatch
    monkeypatch.undo()
    pdl.reload_switch()


def test_off_the_gpu_and_when_switched_off(env_switch: pytest.MonkeyPatch) -> None:
    assert pdl.pdl_launch(torch.device("cpu")) == {}
    env_switch.setenv("KVSCALE_PDL", "0")
    assert pdl.reload_switch() is False
    assert pdl.pdl_launch(torch.device("cuda")) == {}  # decided before asking the device
    env_switch.setenv("KVSCALE_PDL", "1")
    assert pdl.reload_switch() is True


def _ptx(fn: Any, sig: dict[str, str], consts: dict[str, Any], **opts: Any) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = sig | {n: "constexpr" for n in consts}
    # what a launch specializes: pointers and sizes divisible by 16
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, ty) in enumerate(sig.items())
        if ty.startswith("*") or name.startswith("stride")
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert kernel.metadata.launch_pdl is bool(consts.get("PDL"))
    return kernel.asm["ptx"]


def _memory_ops(ptx: str) -> list[str]:
    """The kernel's global loads, stores and atomics, and its griddepcontrol
    instructions, in program order (their opcodes)."""
    return re.findall(r"\b((?:ld|st|atom|red)\.global[.\w]*|griddepcontrol\.\w+)", ptx)


def _gemv_ptx(PDL: int) -> str:
    from kvscale.kernels.w4a16 import _w4a16_gemv_kernel

    ptrs = ["a_ptr", "qw_ptr", "s_ptr", "z_ptr", "perm_ptr", "c_ptr", "p_ptr", "lock_ptr"]
    types = ["*bf16", "*i32", "*fp32", "*u8", "*i32", "*bf16", "*fp32", "*i32"]
    sig = dict(zip(ptrs, types, strict=True))
    sig |= {n: "i32" for n in ("N", "K", "k_per_split", "stride_qk", "stride_sg")}
    sig |= {"stride_zg": "i32", "stride_cs": "i32"}
    consts = dict(BLOCK_N=256, BLOCK_K=128, GROUP_SIZE=128, HAS_PERM=0, SPLIT=1, FIXUP=1)
    consts |= {"EVEN": 1, "PDL": PDL}
    return _ptx(_w4a16_gemv_kernel, sig, consts, num_warps=2, num_stages=1, launch_pdl=bool(PDL))


def test_the_gemv_requests_its_first_weights_before_the_wait_and_nothing_else() -> None:
    ops = _memory_ops(_gemv_ptx(1))
    assert ops.count(WAIT) == 1 and ops.count(RELEASE) == 1
    before, after = ops[: ops.index(WAIT)], ops[ops.index(WAIT) + 1 :]
    # the tile's 16 x 256 words in 16-byte vectors (2 warps: 4 columns a thread) and
    # the group's scales and zero points; no activation (16-bit), store or atomic
    words = [op for op in before if op.startswith("ld.global") and ".v4.b32" in op]
    assert len(words) >= 16, before
    assert not [op for op in before if not op.startswith("ld.global") or ".b16" in op]
    assert any(".b16" in op for op in after)  # the activations, after the wait
    assert any(op.startswith("atom.global") for op in after)  # the split's ticket
    assert WAIT not in _memory_ops(_gemv_ptx(0))


def _small_kernels() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    from kvscale.kernels import activation, paged_decode, rmsnorm

    rows = {"num_rows": "i32", "hidden": "i32", "eps": "fp32"}
    return [
        (
            "rms_norm",
            rmsnorm._rms_norm_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
            | rows
            | {"stride_x": "i32", "stride_o": "i32"},
            {"BLOCK": 4096},
        ),
        (
            "fused_add_rms_norm",
            rmsnorm._fused_add_rms_norm_kernel,
            {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16"}
            | rows
            | {"stride_x": "i32", "stride_r": "i32"},
            {"BLOCK": 4096},
        ),
        (
            "silu_and_mul",
            activation._silu_and_mul_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", "num_rows": "i32", "inter": "i32"}
            | {"stride_x": "i32", "stride_o": "i32"},
            {"BLOCK": 1024},
        ),
        (
            "split_reduce",
            paged_decode._split_reduce_kernel,
            {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16"}
            | {"num_seqs": "i32", "num_heads": "i32", "stride_ob": "i32", "stride_oh": "i32"},
            {"HEAD_DIM": 128, "NUM_SPLITS": 4, "SPLITS_PAD": 4},
        ),
    ]


@pytest.mark.parametrize("name", [k[0] for k in _small_kernels()])
def test_the_small_kernels_wait_before_any_load_or_store(name: str) -> None:
    _, fn, sig, consts = next(k for k in _small_kernels() if k[0] == name)
    ops = _memory_ops(_ptx(fn, sig, consts | {"PDL": 1}, num_warps=4, launch_pdl=True))
    assert ops[:2] == [WAIT, RELEASE], ops[:4]
    assert ops.count(WAIT) == 1 and len(ops) > 2
