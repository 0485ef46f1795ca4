"""The compilation configuration: which token counts are captured, how pieces compile.

``CompilationConfig`` is derived once from ``EngineConfig`` (its ``cuda_graph_mode`` and
``piecewise_*``/``compile_*`` settings). Token-count buckets: a step of ``n`` new tokens
runs as the smallest captured size ``>= n`` (its rows past ``n`` are padding); a step
larger than the largest size runs without graphs. This module imports no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscale.server.config import EngineConfig

CUDA_GRAPH_MODES = ("auto", "full_and_piecewise", "full_decode_only", "piecewise", "none")
PIECE_COMPILERS = ("eager", "inductor")
DEFAULT_SPLIT_OPS = ("kvscale::paged_attention",)
# A mixed step of an 8B model takes ~15 ms to launch from Python (bench/NOTES.md e5); past
# ~1k tokens its GEMMs take longer than that, the launch hides behind them and graphs stop
# paying while padding still costs (predictions in bench/NOTES.md e7).
DEFAULT_PIECEWISE_MAX_TOKENS = 1024


def capture_step(size: int) -> int:
    """The gap after ``size`` in the default buckets: 8 below 64 tokens, 16 below 128,
    32 below 1024 (where an 8B model's mixed steps turn compute-bound, so padding costs
    GPU time: at most ~12% and 3% at 1024), then a sixteenth of the size's power of two."""
    if size < 64:
        return 8
    if size < 128:
        return 16
    if size < 1024:
        return 32
    return (1 << (size.bit_length() - 1)) // 16


def default_capture_sizes(max_tokens: int) -> list[int]:
    """Token buckets from 8 up to ``max_tokens`` (always included when >= 1), spaced by
    ``capture_step``: 8, 16, ..., 64, 80, ..., 128, 160, ..., 1024 (40 sizes), 1088, ..."""
    if max_tokens < 1:
        return []
    sizes = []
    size = 8
    while size < max_tokens:
        sizes.append(size)
        size += capture_step(size)
    return [*sizes, max_tokens]


def parse_sizes(name: str, text: str | None) -> list[int] | None:
    """``"8,16,32"`` -> ``[8, 16, 32]`` (sorted, unique); None/"" -> None. ValueError
    naming the setting for anything but positive integers."""
    if text is None or not text.strip():
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(
                f"{name}: {part!r} is not a positive integer (expected a comma-separated "
                f"list of token counts, e.g. '8,16,32'), got {text!r}"
            )
        out.add(int(part))
    return sorted(out)


def parse_split_ops(text: str) -> tuple[str, ...]:
    """``"ns::op,ns2::op2"`` -> the op names; each must be ``namespace::name``."""
    ops = tuple(p.strip() for p in text.split(",") if p.strip())
    for op in ops:
        ns, sep, name = op.partition("::")
        if not sep or not ns.isidentifier() or not name.isidentifier():
            raise ValueError(
                f"piecewise_split_ops: {op!r} is not a custom op name 'namespace::name' "
                f"(e.g. {DEFAULT_SPLIT_OPS[0]!r})"
            )
    if not ops:
        raise ValueError(
            f"piecewise_split_ops: at least the attention op is needed ({DEFAULT_SPLIT_OPS[0]!r})"
        )
    return ops


def bucket_for(sizes: list[int] | tuple[int, ...], n: int) -> int | None:
    """The smallest size ``>= n`` in the sorted ``sizes``, or None if ``n`` is larger."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class CompilationConfig:
    """How the model is compiled and captured for mixed steps.

    ``capture_sizes``: token buckets captured as piecewise CUDA graphs, ascending.
    ``compiler``: "eager" (the pieces run as traced, the elementwise kernels as opaque
    custom ops: ``ops.routing_for_tracing``) or "inductor" (Inductor fuses each piece).
    ``compile_sizes``: buckets each piece is also compiled for with static shapes
    (Inductor only); every other bucket runs the one dynamic-shape compilation.
    ``split_ops``: custom ops the graph is split at (``namespace::name``); they run
    eagerly between the pieces. ``cache_dir``: where compiled pieces are kept between
    starts (None: not kept). ``debug``: check input addresses on every replay and
    write the split graph's code to the cache folder.
    """

    capture_sizes: tuple[int, ...]
    compiler: str = "eager"
    compile_sizes: tuple[int, ...] = ()
    split_ops: tuple[str, ...] = DEFAULT_SPLIT_OPS
    cache_dir: str | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        if self.compiler not in PIECE_COMPILERS:
            raise ValueError(f"compiler must be one of {PIECE_COMPILERS}, got {self.compiler!r}")
        if list(self.capture_sizes) != sorted(set(self.capture_sizes)) or not all(
            s >= 1 for s in self.capture_sizes
        ):
            raise ValueError(f"capture_sizes must ascend, got {self.capture_sizes}")
        if not set(self.compile_sizes) <= set(self.capture_sizes):
            raise ValueError(
                f"compile_sizes {self.compile_sizes} must be captured sizes {self.capture_sizes}"
            )

    @property
    def max_capture_size(self) -> int:
        return self.capture_sizes[-1] if self.capture_sizes else 0

    def bucket(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` pads to, None: above every size."""
        return bucket_for(self.capture_sizes, num_tokens)

    @property
    def split_op_targets(self) -> frozenset[str]:
        """The split ops as FX prints call targets (``namespace.name``)."""
        return frozenset(op.replace("::", ".") for op in self.split_ops)

    @classmethod
    def from_engine(cls, eng: EngineConfig) -> CompilationConfig:
        """The configuration of validated engine settings."""
        max_tokens = int(eng.max_num_batched_tokens or 0)
        sizes = parse_sizes("piecewise_capture_sizes", eng.piecewise_capture_sizes)
        if sizes is None:
            sizes = default_capture_sizes(min(eng.piecewise_max_tokens, max_tokens))
        compile_sizes = parse_sizes("piecewise_compile_sizes", eng.piecewise_compile_sizes)
        return cls(
            capture_sizes=tuple(sizes),
            compiler=eng.piecewise_compiler,
            compile_sizes=tuple(compile_sizes or ()),
            split_ops=parse_split_ops(eng.piecewise_split_ops),
            cache_dir=eng.compile_cache_dir or None,
            debug=eng.compile_debug,
        )


def auto_graph_mode(
    *,
    cuda: bool,
    triton: bool,
    quantized: bool,
    fp8_at_load: bool,
    kv_quantized: bool,
    tensor_parallel: bool,
    speculative: bool,
    compiled: bool,
) -> tuple[str, str]:
    """What ``cuda_graph_mode='auto'`` runs, and why: piecewise graphs for mixed steps
    where they are GPU-tested and measured (an unquantized model, or one quantized to FP8
    at load (``fp8_at_load``), with a 16-bit KV cache on one CUDA GPU, the Triton backend,
    no speculation, no ``--compile``: bench/NOTES.md e72, e73, "e101 measured"),
    whole-model decode graphs alone otherwise."""
    reasons = [
        why
        for why, applies in (
            ("not on a CUDA GPU", not cuda),
            ("not the Triton attention backend", not triton),
            ("a checkpoint's quantized weights", quantized and not fp8_at_load),
            ("a quantized KV cache", kv_quantized),
            ("tensor parallelism", tensor_parallel),
            ("speculative decoding", speculative),
            ("--compile", compiled),
        )
        if applies
    ]
    if reasons:
        return "full_decode_only", "piecewise graphs are not tested with " + ", ".join(reasons)
    if quantized:
        return "full_and_piecewise", "FP8 weights quantized at load on one GPU"
    return "full_and_piecewise", "an unquantized model on one GPU"


def check_engine_settings(eng: EngineConfig) -> None:
    """Cross-checks of the compilation settings (each one alone is checked by its
    field); ValueError naming the setting, its value and what is allowed."""
    max_tokens = int(eng.max_num_batched_tokens or 0)
    sizes = parse_sizes("piecewise_capture_sizes", eng.piecewise_capture_sizes)
    if sizes is not None and sizes[-1] > max_tokens:
        raise ValueError(
            f"piecewise_capture_sizes: {sizes[-1]} is larger than max_num_batched_tokens "
            f"({max_tokens}), so no step could use it; list sizes <= {max_tokens}"
        )
    if sizes is None:
        sizes = default_capture_sizes(min(eng.piecewise_max_tokens, max_tokens))
    compile_sizes = parse_sizes("piecewise_compile_sizes", eng.piecewise_compile_sizes) or []
    stray = [s for s in compile_sizes if s not in sizes]
    if stray:
        raise ValueError(
            f"piecewise_compile_sizes: {_show(stray)} are not captured sizes, so no step "
            f"would run them; pick from the captured sizes {_show(sizes)}"
        )
    if compile_sizes and eng.piecewise_compiler != "inductor":
        raise ValueError(
            "piecewise_compile_sizes needs piecewise_compiler='inductor' (the eager "
            f"compiler has nothing to specialize), got {eng.piecewise_compiler!r}"
        )
    parse_split_ops(eng.piecewise_split_ops)
    if eng.enforce_eager and eng.cuda_graph_mode in ("full_and_piecewise", "piecewise"):
        raise ValueError(
            f"enforce_eager=True turns CUDA graphs off, which contradicts "
            f"cuda_graph_mode={eng.cuda_graph_mode!r}; use cuda_graph_mode='none' alone"
        )


def _show(sizes: Iterable[int]) -> str:
    sizes = list(sizes)
    text = ", ".join(map(str, sizes[:12]))
    return text + (f", ... ({len(sizes)} sizes)" if len(sizes) > 12 else "")
