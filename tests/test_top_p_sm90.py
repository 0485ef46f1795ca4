"""The top-p kernel compiled for Hopper on this CPU machine: it compiles (the interpreter
ran a constexpr reassignment the compiler rejects), and each pass reads the row in 16-byte
loads."""

from __future__ import annotations

import pytest

from tests.sm90 import compile_sm90, opcode, sass


@pytest.mark.parametrize("digit_bits", [3, 4])
def test_compiles_for_sm90_with_wide_loads(digit_bits: int) -> None:
    pytest.importorskip("triton")
    from kvscale.kernels.top_p import _top_p_threshold_kernel, block_for

    types = {"probs_ptr": "*fp32", "top_p_ptr": "*fp32", "tau_ptr": "*fp32"}
    types |= {"vocab": "i32", "stride": "i32"}
    consts = {"BLOCK": block_for(digit_bits), "DIGIT_BITS": digit_bits}
    # a launch over 128,256-token rows: pointers and sizes divisible by 16
    kernel = compile_sm90(
        _top_p_threshold_kernel, types, consts, set(types), num_warps=consts["BLOCK"] // 128
    )
    loads = [opcode(i) for i in sass(kernel) if opcode(i).startswith("LDG")]
    # one scalar load (the row's top_p), then one 16-byte load of the row per pass
    passes = -(-30 // digit_bits)
    assert sorted(loads) == ["LDG.E"] + ["LDG.E.128"] * passes, loads
