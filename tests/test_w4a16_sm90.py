"""The packed W4A16 GEMV compiled for sm_90 here (no GPU needed): its inline PTX is
accepted by ptxas and becomes bf16x2 FMAs, and the kernel takes fewer instructions than
the one-nibble-at-a-time GEMV. Its numbers are checked on a GPU
(``tests/kernels/test_w4a16.py::test_w4a16_packed_gemv_8b_shapes_gpu``)."""

from __future__ import annotations


def _compile(packed: int) -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvscale.kernels.w4a16 import _w4a16_gemv_kernel

    names = ["a_ptr", "qw_ptr", "s_ptr", "z_ptr", "perm_ptr", "c_ptr", "p_ptr", "lock_ptr"]
    types = ["*bf16", "*i32", "*fp32", "*u8", "*i32", "*bf16", "*fp32", "*i32"]
    sig: dict[str, str] = dict(zip(names, types, strict=True))
    ints = ("N", "K", "k_per_split", "stride_qk", "stride_sg", "stride_zg", "stride_cs")
    sig |= {name: "i32" for name in ints}
    consts = dict(BLOCK_N=256, BLOCK_K=128, GROUP_SIZE=128, HAS_PERM=False, SPLIT=True,
                  FIXUP=True, EVEN=1, PACKED=packed)  # fmt: skip
    sig |= {name: "constexpr" for name in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names) + len(ints))}
    src = ASTSource(fn=_w4a16_gemv_kernel, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
    return kernel.asm


def test_the_packed_gemv_compiles_to_bf16x2_fmas_and_fewer_instructions() -> None:
    packed, plain = _compile(1), _compile(0)
    assert packed["cubin"] and plain["cubin"]  # ptxas accepted the inline PTX
    ptx = str(packed["ptx"])
    # 256 columns over 64 threads, 16 word rows a tile: 64 words a thread, 8 FMAs each
    assert ptx.count("fma.rn.bf16x2") == 64 * 8
    assert "fma.rn.bf16x2" not in str(plain["ptx"])
    # the cubin holds one 16-byte word an instruction: its size tracks their count
    assert len(packed["cubin"]) < 0.8 * len(plain["cubin"])  # type: ignore[arg-type]
