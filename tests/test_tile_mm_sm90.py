"""The tiled GEMM compiled for Hopper on this CPU machine: bf16 and FP8 tiles become
``wgmma`` (HGMMA / QGMMA) fed by pipelined asynchronous copies or by the TMA, with no
spills, and the row count is not a specialization (decode steps' rows vary)."""

from __future__ import annotations

import pytest

from tests.sm90 import compile_sm90, opcode, sass

CASES = [("bf16", 2), ("fp8e4nv", 1)]


def _compile(dtype: str, size: int, cfg, tma: bool):
    from kvscale.kernels.tile_mm import _tile_mm_kernel, _tile_mm_tma_kernel

    bk = cfg.block_k_bytes // size
    scales = {"out_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    consts = {"SCALED": dtype != "bf16", "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
              "BLOCK_K": bk, "DOT_PRECISION": "tf32"}  # fmt: skip
    if tma:
        types = {"x_desc": f"tensordesc<{dtype}[{cfg.block_m}, {bk}]>",
                 "w_desc": f"tensordesc<{dtype}[{cfg.block_n}, {bk}]>"} | scales  # fmt: skip
        types |= {n: "i32" for n in ("M", "N", "K", "stride_om")}
        fn, divisible = _tile_mm_tma_kernel, set(types) - {"M", "x_desc", "w_desc"}
    else:
        types = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}"} | scales
        types |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")}
        fn, divisible = _tile_mm_kernel, set(types) - {"M"}
        consts["EVEN_K"] = True
    # an 8B layer's launch: pointers, N, K and strides divisible by 16
    return compile_sm90(fn, types, consts, divisible, cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("tma", [False, True], ids=["ldgsts", "tma"])
@pytest.mark.parametrize("dtype,size", CASES, ids=[c[0] for c in CASES])
def test_tiles_run_on_wgmma_without_spills(dtype: str, size: int, tma: bool) -> None:
    pytest.importorskip("triton")
    from kvscale.kernels.tile_mm import DEFAULT_CONFIG, TileConfig

    for cfg in (DEFAULT_CONFIG, TileConfig(64, 128, 128, 4, 4), TileConfig(256, 128, 128, 8, 3)):
        ops = [opcode(x) for x in sass(_compile(dtype, size, cfg, tma))]
        assert not [op for op in ops if op.startswith(("STL", "LDL"))], (cfg, "spills")
        gmma = "HGMMA" if dtype == "bf16" else "QGMMA"
        assert any(op.startswith(gmma) for op in ops), (cfg, sorted(set(ops)))
        loads = "UTMALDG" if tma else "LDGSTS"
        assert any(op.startswith(loads) for op in ops), (cfg, sorted(set(ops)))


def test_the_row_count_is_not_specialized() -> None:
    pytest.importorskip("triton")
    from kvscale.kernels.tile_mm import _tile_mm_kernel, _tile_mm_tma_kernel

    for fn in (_tile_mm_kernel, _tile_mm_tma_kernel):
        assert [p.name for p in fn.params if p.do_not_specialize] == ["M"]
