"""Pure-PyTorch attention over the paged cache: the CPU path and the reference.

It runs the references that sit beside the Triton kernels (``*_ref``), one
implementation of the maths for both.
"""

from __future__ import annotations

import torch

from kvscale.kernels.kv_cache import write_kv_cache_ref
from kvscale.kernels.paged_prefill import paged_prefill_attention_ref
from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.worker.kv_pool import LayerKV


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> None:
        write_kv_cache_ref(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)

    def attend(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        meta.check_tokens(q, "q")
        return paged_prefill_attention_ref(
            q,
            kv.k,
            kv.v,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            k_scale=kv.k_scale,
            v_scale=kv.v_scale,
        )
