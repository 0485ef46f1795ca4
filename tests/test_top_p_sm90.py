"""The top-p kernel compiled for Hopper on this CPU machine: each of its launches compiles
(the interpreter ran a constexpr reassignment the compiler rejects), reads the row in
16-byte loads and keeps its per-lane sums in registers."""

from __future__ import annotations

import pytest

from tests.sm90 import compile_sm90, opcode, sass


@pytest.mark.parametrize("digit_bits", [3, 5])
def test_each_pass_compiles_for_sm90_with_wide_loads(digit_bits: int) -> None:
    pytest.importorskip("triton")
    from kvscale.kernels.top_p import CHUNK, _top_p_pass_kernel, block_for, passes_for, warps_for

    ptrs = ("probs_ptr", "top_p_ptr", "masses_ptr", "above_ptr")
    types = {n: "*fp32" for n in ptrs} | {"prefix_ptr": "*i32"}
    types |= {n: "i32" for n in ("vocab", "stride", "num_rows", "num_chunks")}
    block, passes = block_for(digit_bits), passes_for(digit_bits)
    for i in (0, 1, 2, passes):  # the first, the first two that read state, the last
        consts = {"PASS": i, "PASSES": passes, "DIGIT_BITS": digit_bits, "CHUNK": CHUNK}
        consts |= {"BLOCK": block, "CHUNKS_PAD": 32}
        # a launch over 128,256-token rows: pointers and sizes divisible by 16
        kernel = compile_sm90(_top_p_pass_kernel, types, consts, set(types), warps_for(digit_bits))
        ops = [opcode(x) for x in sass(kernel)]
        assert not [op for op in ops if op.startswith(("STL", "LDL"))], "spills"
        if i < passes:
            assert "LDG.E.128" in ops, ops  # the row's chunk


def test_the_row_count_is_not_specialized() -> None:
    # steps' row counts vary: a variant per divisibility would compile mid-serving
    pytest.importorskip("triton")
    from kvscale.kernels.top_p import _top_p_pass_kernel

    assert [p.name for p in _top_p_pass_kernel.params if p.do_not_specialize] == ["num_rows"]
