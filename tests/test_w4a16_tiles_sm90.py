"""The W4A16 tile kernel compiled for Hopper on this CPU machine: its words come by the
TMA, its MMAs are fp16 / bf16 HMMAs, nothing spills at the default's 256 rows of K a
step, no byte permutes re-pair the unpacked values (a few convert the zero points), and
its loop costs at most ~4.5 instructions a weight (the fp32 dequantization of
``kernels/w4a16.py`` ~9.6-11.6 by the same count: the point of this kernel). At 512 rows
a step and 4 warps it spills: the bench's configs keep 128 weights or fewer a thread."""

from __future__ import annotations

import pytest

from tests.sm90 import compile_sm90, opcode, sass


def _ops(dtype: str, block_k: int, group: int, zero_points: bool) -> list[str]:
    from kvscale.kernels.w4a16_tiles import _w4a16_tiles_kernel

    block_n, warps, stages = 64, 4, 4
    types = {"x_ptr": f"*{dtype}", "w_desc": f"tensordesc<i32[{block_n}, {block_k // 8}]>",
             "s_ptr": "*fp32", "z_ptr": "*u8", "out_ptr": f"*{dtype}"}  # fmt: skip
    types |= {n: "i32" for n in ("M", "N", "K", "num_groups", "stride_xm", "stride_sg",
                                 "stride_zg", "stride_om")}  # fmt: skip
    consts = {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE": group,
              "TG": max(1, block_k // group), "HAS_ZP": zero_points, "BF16": dtype == "bf16",
              "ASM": True, "OFFSET": 128.0 if dtype == "bf16" else 1024.0}  # fmt: skip
    # an 8B layer's launch: sizes and strides divisible by 16
    kernel = compile_sm90(_w4a16_tiles_kernel, types, consts, set(types) - {"M", "w_desc"},
                          warps, stages)  # fmt: skip
    return [opcode(x) for x in sass(kernel)]


@pytest.mark.parametrize("zero_points", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_loop_stays_under_its_instruction_budget(dtype: str, zero_points: bool) -> None:
    pytest.importorskip("triton")
    small, large = (_ops(dtype, bk, 128, zero_points) for bk in (128, 256))
    for ops in (small, large):
        assert not [op for op in ops if op.startswith(("STL", "LDL"))], "spills"
        assert any(op.startswith("UTMALDG") for op in ops)
        assert any(op.startswith("HMMA") for op in ops)
        # a re-pairing would take one a pair: 64 at the larger tile
        assert ops.count("PRMT") <= 16, "the lop3 pairs re-packed"
    # the loop body grows with the tile: 64 columns x 128 more rows over 128 threads
    per_weight = (len(large) - len(small)) / (64 * 128 / 128)
    assert per_weight < 4.5, per_weight
