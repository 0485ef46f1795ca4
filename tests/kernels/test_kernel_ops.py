"""The elementwise kernels as custom ops (``server/layers/kernel_ops.py``): each passes
torch's own op checks (schema, fake, mutation declared), and a layer traced while ``ops``
routes to them keeps each fused kernel as one node, computing what the kernels compute
eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kvscale.kernels import rmsnorm
from kvscale.server.layers import ops
from kvscale.server.layers.activation import SiluAndMul
from kvscale.server.layers.kernel_ops import OPS
from kvscale.server.layers.layernorm import RMSNorm

H, INTER, GROUP = 64, 128, 64


def cases(device: Any) -> list[tuple[Any, tuple[Any, ...]]]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    w = t(H)
    return [
        (OPS["rms_norm"], (t(8, H), w, 1e-6)),
        (OPS["fused_add_rms_norm"], (t(8, H), t(8, H), w, 1e-6)),
        (OPS["fused_add_rms_norm_quant"], (t(8, H), t(8, H), w, 1e-6, GROUP)),
        (OPS["silu_and_mul"], (t(8, 2 * INTER),)),
        (OPS["silu_and_mul_quant"], (t(8, 2 * INTER), GROUP)),
        (OPS["fp8_quantize_groups"], (t(8, H), GROUP)),
    ]


def test_each_op_passes_torchs_op_checks(device: Any) -> None:
    for op, args in cases(device):
        torch.library.opcheck(op, args)


class Mlp(nn.Module):
    """A decoder layer's piece between two attentions: add + norm, gate/up, SiLU-and-mul,
    down (the model's own norm and activation layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(H)
        nn.init.normal_(self.norm.weight)
        self.gate_up = nn.Linear(H, 2 * INTER, bias=False)
        self.act = SiluAndMul()
        self.down = nn.Linear(INTER, H, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.norm(x, residual)
        return self.down(self.act(self.gate_up(h))), residual


def traced(routing: Any, mlp: Mlp, x: torch.Tensor, r: torch.Tensor) -> tuple[set[str], Any]:
    """The call targets of the graph Dynamo traces under ``routing``, and its outputs."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    with routing, torch.inference_mode():
        out = torch.compile(mlp, backend=backend, fullgraph=True)(x, r)
    (gm,) = graphs
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}, out


def test_traced_layers_keep_the_kernels_as_one_node_each(device: Any) -> None:
    mlp = Mlp().to(device)
    x, r = torch.randn(8, H, device=device), torch.randn(8, H, device=device)
    with ops.kernels(True), torch.inference_mode():
        want = mlp(x.clone(), r.clone())

    targets, got = traced(ops.routing_for_tracing("eager", True), mlp, x.clone(), r.clone())
    assert {"kvscale.fused_add_rms_norm.default", "kvscale.silu_and_mul.default"} <= targets
    assert not any("rsqrt" in t or "silu" in t.split(".")[-1] for t in targets), targets
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)  # the same kernels on the same inputs

    # Inductor's trace (and any model running on the references) sees the references
    targets, _ = traced(ops.routing_for_tracing("inductor", True), mlp, x.clone(), r.clone())
    assert not any(t.startswith("kvscale.") for t in targets), targets
    assert any("rsqrt" in t for t in targets), targets


@pytest.mark.parametrize(
    "compiler,kernels_on", [("eager", False), ("inductor", False), ("inductor", True)]
)
def test_the_other_traces_see_the_references(compiler: str, kernels_on: bool) -> None:
    with ops.kernels(True):
        with ops.routing_for_tracing(compiler, kernels_on):
            assert not ops.routed_to_kernels()
            assert ops.rms_norm is rmsnorm.rms_norm_ref
        assert ops.rms_norm is rmsnorm.rms_norm  # the routing before, after
