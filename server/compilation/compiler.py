"""Compiling one piece, with caches in memory and on disk.

A piece is compiled for the dynamic token dimension (``runtime_shape`` None) or for one
bucket's static shape. Compiled code is kept under the key (runtime shape, piece index,
compiler), and behind that under a fingerprint of the piece's content (its graph with
node names erased, its inputs' shapes and dtypes, the shape, the compiler, torch's
build): the 30 identical middle pieces of a 32-layer model compile once, and a restart
loads each unique piece from ``cache_dir`` instead of compiling it (Inductor's
``standalone_compile`` artifacts; Inductor's FX graph cache is on as well).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS: dict[str, Any] = {"fx_graph_cache": True, "fx_graph_remote_cache": False}


@dataclass
class CompileStats:
    compiled: int = 0  # pieces compiled now
    loaded: int = 0  # pieces loaded from the disk cache
    reused: int = 0  # pieces sharing code compiled for an identical piece
    seconds: float = 0.0  # spent compiling and loading


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    try:
        return fx.node._get_qualified_name(target)
    except Exception:
        return repr(target)


def _value_text(value: Any, names: dict[fx.Node, str]) -> str:
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, tuple | list):
        inner = ",".join(_value_text(v, names) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value_text(v, names)}" for k, v in value.items()) + "}"
    return repr(value)


def _input_text(value: Any, symbols: dict[str, str]) -> str:
    def sym(x: Any) -> str:
        if isinstance(x, torch.SymInt):
            return symbols.setdefault(str(x), f"s{len(symbols)}")
        return str(x)

    if isinstance(value, torch.Tensor):
        shape = ",".join(sym(d) for d in value.shape)
        stride = ",".join(sym(d) for d in value.stride())
        return f"T({value.dtype},{value.device.type},[{shape}],[{stride}])"
    if isinstance(value, torch.SymInt):
        return f"S({sym(value)})"
    return repr(value)


def fingerprint(
    gm: fx.GraphModule, example_inputs: Sequence[Any], runtime_shape: int | None, compiler: str
) -> str:
    """A hex key of ``fingerprint_text``."""
    text = fingerprint_text(gm, example_inputs, runtime_shape, compiler)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fingerprint_text(
    gm: fx.GraphModule, example_inputs: Sequence[Any], runtime_shape: int | None, compiler: str
) -> str:
    """What the compiled code depends on: ``gm``'s nodes in order with their names
    replaced by positions, the inputs' dtypes, devices and (symbolic) shapes and strides,
    the runtime shape, the compiler and torch's own build."""
    names: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"%{i}"
        args = _value_text(node.args, names)
        kwargs = _value_text(node.kwargs, names)
        target = "" if node.op == "placeholder" else _target_name(node.target)  # a name
        lines.append(f"{node.op} {target} {args} {kwargs}")
    symbols: dict[str, str] = {}
    lines += [_input_text(x, symbols) for x in example_inputs]
    lines.append(f"shape={runtime_shape} compiler={compiler} torch={torch.__version__}")
    cuda = {x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda}
    for device in sorted(cuda, key=str):  # compiled kernels are for one GPU architecture
        import triton

        cap = torch.cuda.get_device_capability(device)
        lines.append(
            f"{torch.cuda.get_device_name(device)} sm_{cap[0]}{cap[1]} {triton.__version__}"
        )
    if compiler == "inductor":
        from torch._inductor.codecache import torch_key

        lines.append(torch_key().hex())
        lines.append(repr(sorted(INDUCTOR_OPTIONS.items())))
    return "\n".join(lines)


def _returns_tuple(gm: fx.GraphModule) -> bool:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(out.args[0], tuple | list)


class PieceCompiler:
    """Compiles pieces with ``compiler`` ("inductor" or "eager"), caching the results."""

    def __init__(self, compiler: str, cache_dir: str | None) -> None:
        self.compiler = compiler
        self.cache_dir = Path(cache_dir) / "pieces" if cache_dir else None
        self.by_index: dict[tuple[int | None, int, str], Callable[..., Any]] = {}
        self._by_key: dict[str, Callable[..., Any]] = {}
        self.stats = CompileStats()

    def compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        runtime_shape: int | None = None,
    ) -> Callable[..., Any]:
        """Compiled code of piece ``index`` for ``runtime_shape`` (None: the dynamic token
        dimension, ``example_inputs`` fake tensors with symbolic sizes; an int: that
        bucket's size, ``example_inputs`` the real inputs)."""
        slot = (runtime_shape, index, self.compiler)
        fn = self.by_index.get(slot)
        if fn is not None:
            return fn
        if self.compiler == "eager":
            fn = gm.forward
        else:
            start = time.perf_counter()
            fn = self._inductor(gm, example_inputs, runtime_shape)
            self.stats.seconds += time.perf_counter() - start
        self.by_index[slot] = fn
        return fn

    def _inductor(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], runtime_shape: int | None
    ) -> Callable[..., Any]:
        from torch._inductor import CompiledArtifact, standalone_compile

        key = fingerprint(gm, example_inputs, runtime_shape, self.compiler)
        if key in self._by_key:
            self.stats.reused += 1
            return self._by_key[key]
        path = self.cache_dir / f"{key}.bin" if self.cache_dir else None
        artifact = None
        if path is not None and path.is_file():
            try:
                artifact = CompiledArtifact.load(path=str(path), format="binary")
                self.stats.loaded += 1
            except Exception as e:  # a torn or stale file: compile again
                log.warning("compile cache: could not load %s (%s); compiling again", path, e)
        if artifact is None:
            artifact = standalone_compile(
                gm,
                list(example_inputs),
                dynamic_shapes="from_graph" if runtime_shape is None else "from_example_inputs",
                options={"config_patches": dict(INDUCTOR_OPTIONS)},
            )
            self.stats.compiled += 1
            if path is not None:
                self._save(artifact, path)
        fn = _unpacking(artifact, _returns_tuple(gm))
        self._by_key[key] = fn
        return fn

    @staticmethod
    def _save(artifact: Any, path: Path) -> None:
        """Writes ``artifact`` atomically (servers starting together share the folder)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            artifact.save(path=str(tmp), format="binary")
            os.replace(tmp, path)
        except OSError as e:  # a read-only or full disk only costs the next start
            log.warning("compile cache: could not write %s (%s)", path, e)


def _unpacking(artifact: Any, returns_tuple: bool) -> Callable[..., Any]:
    """The compiled code returning what the piece returns: Inductor's artifacts return a
    list for several outputs and, depending on how they were made (compiled now or
    loaded), the value itself or a one-element list for one."""
    if returns_tuple:
        return artifact  # type: ignore[no-any-return]

    def call(*args: Any) -> Any:
        out = artifact(*args)
        return out[0] if isinstance(out, list | tuple) else out

    return call
