"""Calling a split op's Python code directly between the pieces.

A split op runs eagerly at every step, 32 times for a 32-layer model. Through the
dispatcher, a Python custom op costs tens of microseconds per call (argument checks,
the autograd and in-place/view dispatch keys) on top of its own code; in inference
mode none of that does anything. An op whose Python code is registered here is called
as a plain function instead, with the arguments its split submodule would pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

_IMPLS: dict[str, Callable[..., Any]] = {}


def register_direct_call(op: str, fn: Callable[..., Any]) -> None:
    """``op`` (``namespace::name``) runs as ``fn`` between captured pieces."""
    _IMPLS[op.replace("::", ".")] = fn


def direct_call(gm: fx.GraphModule, op_name: str | None) -> Callable[..., Any] | None:
    """A function standing in for ``gm`` (a split op's submodule: placeholders, one call
    of ``op_name``, an output of nothing) that calls the op's registered code, or None
    when none is registered or ``gm`` is not of that form."""
    fn = _IMPLS.get(op_name or "")
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function"]
    out = nodes[-1]
    if fn is None or len(calls) != 1 or out.op != "output" or out.args[0] not in ((), None):
        return None
    call = calls[0]
    slots = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}

    def spec(a: Any) -> tuple[bool, Any]:
        if isinstance(a, fx.Node):
            if a not in slots:
                raise ValueError(a)
            return True, slots[a]
        return False, a

    try:
        arg_spec = [spec(a) for a in call.args]
        kw_spec = {k: spec(v) for k, v in call.kwargs.items()}
    except ValueError:  # an argument computed inside the submodule
        return None

    def run(*args: Any) -> tuple[()]:
        fn(
            *[args[v] if is_arg else v for is_arg, v in arg_spec],
            **{k: args[v] if is_arg else v for k, (is_arg, v) in kw_spec.items()},
        )
        return ()

    return run
