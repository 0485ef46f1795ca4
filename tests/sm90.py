"""Triton kernels compiled for Hopper (sm_90) on a machine without a GPU: Triton's
compiler and its bundled ptxas run anywhere, and nvdisasm (shipped beside ptxas) prints
the SASS. For tests of what the GPU will be given: vector widths, barriers, the order of
loads."""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

import pytest


def compile_sm90(
    fn: Any,
    types: dict[str, str],
    constexprs: dict[str, Any],
    divisible: set[str],
    num_warps: int,
    num_stages: int | None = None,
) -> Any:
    """``fn`` compiled for sm_90: ``types`` gives each runtime argument's Triton type
    (``"*bf16"``, ``"i32"``), ``constexprs`` the rest; ``divisible``: the arguments a
    launch would find divisible by 16 (pointers and sizes: the loads vectorize)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass(kernel: Any) -> list[str]:
    """The instructions of a compiled kernel's cubin (``LDG.E.128 R4, ...``), in order;
    skips the test where Triton ships no nvdisasm."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    if not os.path.exists(tool):
        pytest.skip("this Triton ships no nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [tool, "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    # lines like "/*0240*/  @P0 LDG.E.128 R16, desc[UR8][R2.64] ;"
    return [line.split("*/", 1)[1].strip() for line in text.splitlines() if "/*" in line]


def opcode(instruction: str) -> str:
    """``LDG.E.128`` of ``@P0 LDG.E.128 R16, ...`` (the predicate dropped)."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def compile_one_shot_sm90(ll: bool = False, dtype: str = "bf16") -> Any:
    """``kernels.one_shot_all_reduce``'s kernel as TP=2 decode launches it on rank 0:
    rows of 4096 (``dtype``: ``bf16``, ``fp16``, ``fp32``) with the fused norm, as flagged
    words (``ll``) or with flags."""
    from kvscale.kernels.one_shot_all_reduce import _one_shot_kernel
    from kvscale.kernels.rmsnorm import row_launch_opts

    opts = row_launch_opts(4096)
    names = ["x_ptr", "res_ptr", "w_ptr", "data_ptrs", "signal_ptrs", "uses_ptr"]
    types = dict(zip(names, [f"*{dtype}"] * 3 + ["*i64", "*i64", "*i32"], strict=True))
    types |= {n: "i32" for n in ("hidden", "max_rows", "stride_x", "stride_r")}
    types |= {"eps": "fp32", "ll_offset": "i64"}
    consts = {"RANK": 0, "WORLD": 2, "NORM": True, "ALIGN": 8, "BLOCK": opts["BLOCK"],
              "LL": ll, "LL_ROWS": 16, "EPW": 1 if dtype == "fp32" else 2}  # fmt: skip
    # what a launch specializes: pointers and sizes divisible by 16
    divisible = set(types) - {"eps"}
    return compile_sm90(_one_shot_kernel, types, consts, divisible, opts["num_warps"])
