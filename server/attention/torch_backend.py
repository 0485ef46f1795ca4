"""Pure-PyTorch attention over the paged cache: the CPU path and the reference."""

from __future__ import annotations

import torch

from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        slots = meta.slot_mapping
        keep = slots >= 0
        if not bool(keep.all()):
            slots, k, v = slots[keep], k[keep], v[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        group = q.shape[1] // k_cache.shape[2]
        starts = meta.query_start_loc_cpu
        for b, seq_len in enumerate(meta.seq_lens_cpu):
            q_b = q[starts[b] : starts[b + 1]]
            n_q = q_b.shape[0]
            if n_q == 0:
                continue
            n_blocks = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[b, :n_blocks].long()
            k_b = k_cache[blocks].flatten(0, 1)[:seq_len]  # [S, Hk, D]
            v_b = v_cache[blocks].flatten(0, 1)[:seq_len]
            k_b = k_b.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [Hq, S, D]
            v_b = v_b.repeat_interleave(group, dim=1).transpose(0, 1).float()
            scores = torch.matmul(q_b.transpose(0, 1).float(), k_b.transpose(1, 2)) * scale
            q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            scores.masked_fill_((k_pos > q_pos).unsqueeze(0), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[starts[b] : starts[b + 1]] = torch.matmul(probs, v_b).transpose(0, 1).to(q.dtype)
        return out
