"""The norm weight and the residual row are loaded at the start of the kernels that
end in an RMSNorm, not after the norm's reduction (NOTES e60): one memory round trip a
call instead of two, in kernels that a decode step launches 64 times, each a single
program and latency-bound. Compiled for sm_90 here; read in the SASS."""

from __future__ import annotations

from tests.sm90 import compile_one_shot_sm90, compile_sm90, opcode, sass


def _first(ops: list[str], prefix: str) -> int:
    return next(i for i, op in enumerate(ops) if op.startswith(prefix))


def test_the_fused_norm_issues_its_weight_load_before_the_reduction() -> None:
    from kvscale.kernels.rmsnorm import _fused_add_rms_norm_kernel, row_launch_opts

    opts = row_launch_opts(4096)
    types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "num_rows": "i32",
             "hidden": "i32", "eps": "fp32", "stride_x": "i32", "stride_r": "i32"}  # fmt: skip
    kernel = compile_sm90(
        _fused_add_rms_norm_kernel, types, {"BLOCK": opts["BLOCK"]},
        {"x_ptr", "res_ptr", "w_ptr", "hidden", "stride_x", "stride_r"}, opts["num_warps"],
    )  # fmt: skip
    ops = [opcode(i) for i in sass(kernel)]
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    assert len(loads) == 6, ops  # x, the residual, the weight: two 16-byte loads each
    assert max(loads) < _first(ops, "BAR.SYNC"), ops


def test_the_all_reduce_loads_residual_and_weight_before_its_flags() -> None:
    ops = [opcode(i) for i in sass(compile_one_shot_sm90())]
    # the local rows (x, the residual, the weight): plain 16-byte loads; the peers' rows
    # are strong (volatile) loads after the flags
    local = [i for i, op in enumerate(ops) if op == "LDG.E.128"]
    assert len(local) == 6, ops
    assert max(local) < _first(ops, "ATOMG"), ops
