"""kvscale's 4-bit unpackers against the formats' published packing loops (transcribed in
tests/int4_checkpoints.py) and an independent bytewise unpacker; the GPTQ v1 zero-point
convention at its edges (zero points 0 and 15); the round-to-nearest quantizer."""

from __future__ import annotations

import torch

from kvscale.kernels.w4a16 import pack_int4_rows, unpack_int4_rows
from kvscale.server.quantization import int4_formats as f

from . import int4_checkpoints as ck


def _codes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint8
    )


def test_awq_matches_autoawqs_packing_loop() -> None:
    codes = _codes(40, 64)
    words = ck.autoawq_pack(codes)
    assert torch.equal(f.pack_awq(codes), words)
    assert torch.equal(f.unpack_awq(words, 64), codes)
    assert torch.equal(ck.bytes_unpack_cols(words, ck.AWQ_ORDER_MAP), codes)
    # the interleave: nibble 1 of word 0 holds column 2, nibble 4 holds column 1
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 1] = 0xF
    assert int(f.pack_awq(one)[0, 0]) == 0xF << 16


def test_gptq_matches_autogptqs_packing_loops() -> None:
    codes, zeros = _codes(64, 64, 1), _codes(4, 64, 2).clamp(min=1)  # AutoGPTQ: no zero 0
    qweight = ck.autogptq_pack_qweight(codes)
    assert torch.equal(qweight, pack_int4_rows(codes))
    assert torch.equal(ck.bytes_unpack_rows(qweight), codes)
    assert torch.equal(unpack_int4_rows(qweight, 64), codes)
    v1 = ck.autogptq_pack_qzeros(zeros)  # per element: zero - 1, then packed
    assert torch.equal(f.unpack_gptq_zeros(v1, 64, v1=True), zeros)
    assert torch.equal(ck.bytes_unpack_cols(v1), zeros - 1)
    v2 = ck.pack_qzeros_v2(zeros)
    assert torch.equal(f.unpack_gptq_zeros(v2, 64, v1=False), zeros)
    assert torch.equal(f.pack_gptq(codes, zeros, v1=True)[1], v1)


def test_gptq_v1_zero_points_at_the_edges() -> None:
    """GPTQModel writes v1 by subtracting 0x11111111 from whole words: a zero point of 0
    borrows from its neighbour (stored as 15, the neighbour one lower). Adding the word
    back, as kvscale does, recovers every zero in 0..15; a per-nibble +1 would not."""
    zeros = torch.tensor([[0, 15, 0, 0, 7, 15, 1, 0], [15] * 8, [0] * 8], dtype=torch.uint8)
    v2 = f.pack_cols(zeros)
    v1 = ck.gptqmodel_v2_to_v1(v2)
    assert torch.equal(f.gptq_zeros_to_v1(v2), v1)
    assert torch.equal(f.unpack_gptq_zeros(v1, 8, v1=True), zeros)
    per_nibble = (ck.bytes_unpack_cols(v1).int() + 1) % 16
    assert not torch.equal(per_nibble, zeros.int())  # why whole words matter


def test_compressed_tensors_layout_matches_its_packer() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = _codes(96, 24, 3)  # [K, N]
    signed = (codes.t().int() - 8).to(torch.int8)  # compressed-tensors' [N, K] int4 values
    packed = pack_to_int32(signed, 4)
    assert torch.equal(f.pack_ct(codes), packed)
    assert torch.equal(f.unpack_ct(packed, 96), codes)
    zeros = _codes(3, 24, 4)  # [G, N]
    zp = pack_to_int32((zeros.t().int() - 8).to(torch.int8), 4, packed_dim=0)
    assert torch.equal(f.pack_ct_zeros(zeros), zp)
    assert torch.equal(f.unpack_ct_zeros(zp, 24), zeros)


def test_quantize_rtn_error_is_at_most_half_a_step() -> None:
    w = torch.randn(16, 96)
    for sym in (False, True):
        codes, scales, zeros = f.quantize_rtn(w, 32, sym)
        assert codes.shape == (96, 16) and scales.shape == zeros.shape == (3, 16)
        deq = (codes.float() - zeros.float().repeat_interleave(32, 0)) * scales.repeat_interleave(
            32, 0
        )
        step = scales.repeat_interleave(32, 0)
        assert ((deq - w.t()).abs() <= step / 2 + 1e-6).all()
        if sym:
            assert (zeros == 8).all()
    g_idx = torch.randperm(96) % 3
    codes, scales, zeros = f.quantize_rtn(w, 32, False, g_idx)
    deq = (codes.float() - zeros.float()[g_idx]) * scales[g_idx]
    assert ((deq - w.t()).abs() <= scales[g_idx] / 2 + 1e-6).all()
