"""Weights brought into the GPU's L2 cache ahead of the GEMM that reads them.

A layer calls :func:`prefetch_weights` with the linear layer it will run next, right
before kernels that leave the memory idle (at small decode batches: the rotary, the
attention and its split-KV reduction between qkv_proj and o_proj). Where the step's
forward context holds a :class:`WeightPrefetch` (the decode CUDA graphs, with
``--l2-prefetch-max-batch``), the layer's parameters are prefetched on a side stream,
so the main stream never waits for it; the forward joins the side stream at its end.
Elsewhere (no context, eager or compiled forwards, a CPU) it does nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from kvscale.kernels.l2_prefetch import dense_span, l2_prefetch
from kvscale.server.attention.forward_context import current_prefetch

L2_SHARE = 0.75  # a layer is prefetched only if its parameters fit in this share of L2


def prefetchable(layer: nn.Module, budget: int) -> list[torch.Tensor]:
    """``layer``'s parameters and buffers that ``l2_prefetch`` takes (non-empty, dense),
    if their bytes fit in ``budget`` (else none: they would not stay in L2 until the
    GEMM reads them)."""
    tensors = [t for t in (*layer.parameters(), *layer.buffers()) if t.numel() and dense_span(t)]
    return tensors if sum(t.numel() * t.element_size() for t in tensors) <= budget else []


class WeightPrefetch:
    """A side stream that prefetches layers' parameters (sm_90+: ``l2_prefetch``)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.budget = int(L2_SHARE * l2)  # bytes
        self.tensors: dict[int, list[torch.Tensor]] = {}
        self.forked = False

    def __call__(self, layer: nn.Module) -> None:
        tensors = self.tensors.get(id(layer))
        if tensors is None:
            tensors = self.tensors[id(layer)] = prefetchable(layer, self.budget)
        if not tensors:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for t in tensors:
                l2_prefetch(t)
        self.forked = True

    def join(self) -> None:
        """Makes the current stream wait for the prefetches (a CUDA-graph capture must
        join every stream it forked before it ends)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


def prefetch_weights(layer: nn.Module) -> None:
    """Prefetches ``layer``'s parameters into L2 if this forward does that (above)."""
    if torch.compiler.is_compiling():
        return  # first: Dynamo must not trace (and guard on) the per-step context
    prefetch = current_prefetch()
    if prefetch is not None:
        prefetch(layer)
