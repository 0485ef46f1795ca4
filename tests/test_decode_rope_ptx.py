"""The decode kernel with the rotary embedding and KV write in it (``RopeWrite``) builds
for Hopper natively (its arithmetic is tested under the interpreter in tests/kernels):
compiled here for sm_90 in bf16, with and without splits and with an FP8 cache. Rotating
before the loop, its PTX holds a barrier more than the kernel without rope (after the K/V
stores); rotating in the loop, the rotary table is read by asynchronous copies (pipelined
beside the first K tile)."""

from __future__ import annotations

import pytest

from tests.sm90 import compile_sm90

POINTERS = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
    "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "k_scale_ptr": "*fp32",
    "v_scale_ptr": "*fp32", "pos_ptr": "*i64", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16",
    "cos_sin_ptr": "*fp32", "slot_ptr": "*i64",
}  # fmt: skip
UNALIGNED = ("num_seqs", "stride_bt", "scale_log2e")  # not specialized, or a float


def _ptx(rope: int, split: bool, fp8: bool) -> str:
    from kvscale.kernels.paged_decode import _paged_decode_kernel

    consts = {"QG": 4, "QG_PAD": 16, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_N": 64,
              "NUM_SPLITS": 8 if split else 1, "SPLIT": split, "DOT_PREC": "ieee",
              "KV_FP8": fp8, "KV_F16": fp8, "ROPE": rope}  # fmt: skip
    types = {n: "fp32" if n == "scale_log2e" else "i32" for n in _paged_decode_kernel.arg_names}
    types |= POINTERS
    if fp8:
        types |= {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    divisible = {n for n in types if n not in consts and n not in UNALIGNED}
    kernel = compile_sm90(_paged_decode_kernel, types, consts, divisible, 4, num_stages=3)
    return kernel.asm["ptx"]


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
