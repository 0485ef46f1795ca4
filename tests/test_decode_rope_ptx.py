"""The decode kernel with the rotary embedding and KV write in it (``RopeWrite``) builds
for Hopper natively (its arithmetic is tested under the interpreter in tests/kernels):
compiled here for sm_90 in bf16, with and without splits and with an FP8 cache. Rotating
before the loop, its PTX holds a barrier more than the kernel without rope (after the K/V
stores); rotating in the loop, the rotary table is read by asynchronous copies (pipelined
beside the first K tile)."""

from __future__ import annotations

import pytest

POINTERS = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
    "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32", "pos_ptr": "*i64", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16",
    "cos_sin_ptr": "*fp32", "slot_ptr": "*i64",
}  # fmt: skip


def _ptx(rope: int, split: bool, fp8: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvscale.kernels.paged_decode import _paged_decode_kernel

    consts = {"QG": 4, "QG_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
              "NUM_SPLITS": 8 if split else 1, "SPLIT": split, "DOT_PREC": "ieee",
              "KV_FP8": fp8, "KV_F16": fp8, "ROPE": rope}  # fmt: skip
    sig = {}
    for name in _paged_decode_kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
            if fp8 and name in ("k_cache_ptr", "v_cache_ptr"):
                sig[name] = "*fp8e4nv"
        else:
            sig[name] = "fp32" if name == "scale_log2e" else "i32"
    # the launch's hints: pointers and sizes divisible by 16 (the loads vectorize)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(_paged_decode_kernel.arg_names)
             if sig[n] != "constexpr" and n not in ("num_seqs", "stride_bt", "scale_log2e")}
    src = ASTSource(fn=_paged_decode_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 3}).asm["ptx"]


@pytest.mark.parametrize(("split", "fp8"), [(False, False), (True, False), (True, True)])
def test_the_rope_decode_kernel_compiles_with_its_barrier(split: bool, fp8: bool) -> None:
    from kvscale.kernels.paged_decode import ROPE_BEFORE_LOOP, ROPE_IN_LOOP

    before = _ptx(ROPE_BEFORE_LOOP, split, fp8)
    plain = _ptx(0, split, fp8)
    assert plain.count("bar.sync") < before.count("bar.sync")
    # in the loop: no barrier of its own (the newest token never goes through the cache)
    # and the rotary table's loads are asynchronous copies beside the first K tile's
    in_loop = _ptx(ROPE_IN_LOOP, split, fp8)
    assert in_loop.count("cp.async.ca") > plain.count("cp.async.ca")
