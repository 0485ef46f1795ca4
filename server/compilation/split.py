"""Splitting a Dynamo FX graph at the ops that cannot be captured.

Every call of a split op (attention) becomes a submodule of its own; the nodes between
two split ops form one piece. ``split_module`` keeps the original node order, which
matters: the graph mutates tensors in place (the residual stream, the rotary embedding,
the attention output buffer), so reordering could read a tensor before its write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module


@dataclass
class SplitItem:
    """One submodule of the split graph, in execution order."""

    name: str  # attribute of the split module ("submod_3")
    index: int  # position in execution order
    is_split_op: bool  # a split op alone (runs eagerly) or a piece (compiled, captured)
    module: fx.GraphModule


def op_target_name(node: fx.Node) -> str | None:
    """``namespace.name`` of a custom op call (overload packet or ``.default``), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    return None


def split_graph(gm: fx.GraphModule, ops: frozenset[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """``gm`` split before and after every call of ``ops`` (names as ``namespace.name``).
    Returns the stitching module (its submodules called in order) and its items."""
    part = 0
    node_part: dict[fx.Node, int] = {}
    split_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if op_target_name(node) in ops:
            part += 1
            node_part[node] = part
            split_parts.add(part)
            part += 1
        else:
            node_part[node] = part
    split_gm = split_module(gm, None, lambda n: node_part[n], keep_original_order=True)
    items = []
    for name, module in split_gm.named_children():
        idx = int(name.removeprefix("submod_"))
        items.append(SplitItem(name, idx, idx in split_parts, module))  # type: ignore[arg-type]
    items.sort(key=lambda it: it.index)
    return split_gm, items
