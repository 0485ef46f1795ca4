"""The flags ``kvscale serve`` takes, to check ``spec.engine.extraArgs`` without the server.

The operator's image has no torch, so it cannot build the server's flag parser or its
``EngineConfig``; the table below is generated from them (``python -m
kvscale.operator.server_flags --write`` rewrites it) and ``tests/operator/
test_server_flags.py`` fails when it no longer matches. With it the operator refuses what
the server would refuse flag by flag: an unknown flag, a flag without its value, a value of
the wrong type, outside its choices or outside its bounds. Checks across flags (e.g.
``--piecewise-compile-sizes`` needs ``--piecewise-compiler inductor``) stay the server's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscale.bounds import Bound


@dataclass(frozen=True)
class Flag:
    """``value``: the type its one value must parse as ("int", "float", "str"), or None for
    a switch, which takes no value; ``many``: one or more values; ``choices``: the allowed
    values; ``lo``/``hi``: bounds (``lo_exclusive``: ``lo`` itself not allowed)."""

    value: str | None
    many: bool = False
    choices: tuple[Any, ...] | None = None
    lo: float | None = None
    hi: float | None = None
    lo_exclusive: bool = False


# BEGIN GENERATED (python -m kvscale.operator.server_flags --write)
FLAGS: dict[str, Flag] = {
    "--api-key": Flag("str"),
    "--attention-backend": Flag("str", choices=("auto", "torch", "triton")),
    "--block-size": Flag("int", choices=(8, 16, 32, 64, 128)),
    "--chat-template": Flag("str"),
    "--compile": Flag(None),
    "--compile-cache-dir": Flag("str"),
    "--compile-debug": Flag(None),
    "--cuda-graph-max-batch": Flag("int", lo=0),
    "--cuda-graph-mode": Flag(
        "str", choices=("auto", "full_and_piecewise", "full_decode_only", "piecewise", "none")
    ),
    "--device": Flag("str"),
    "--disable-access-log": Flag(None),
    "--disable-custom-all-reduce": Flag(None),
    "--drain-timeout": Flag("float", lo=0),
    "--dtype": Flag("str"),
    "--enable-auto-tool-choice": Flag(None),
    "--enable-prefix-caching": Flag(None),
    "--enforce-eager": Flag(None),
    "--engine-stall-timeout": Flag("float", lo=0, lo_exclusive=True),
    "--gpu-memory-utilization": Flag("float", lo=0.0, hi=1.0, lo_exclusive=True),
    "--host": Flag("str"),
    "--kv-cache-dtype": Flag("str", choices=("auto", "fp8", "fp8_e4m3")),
    "--log-level": Flag("str", choices=("debug", "info", "warning", "error")),
    "--max-header-bytes": Flag("int", lo=1024),
    "--max-model-len": Flag("int", lo=2),
    "--max-num-batched-tokens": Flag("int", lo=1),
    "--max-num-seqs": Flag("int", lo=1),
    "--max-queue-len": Flag("int", lo=1),
    "--max-request-body-bytes": Flag("int", lo=0),
    "--model": Flag("str"),
    "--ngram-max": Flag("int", lo=1, hi=16),
    "--ngram-min": Flag("int", lo=1, hi=16),
    "--no-enable-prefix-caching": Flag(None),
    "--no-warmup": Flag(None),
    "--num-kv-blocks": Flag("int", lo=1),
    "--num-speculative-tokens": Flag("int", lo=1, hi=16),
    "--piecewise-capture-sizes": Flag("str"),
    "--piecewise-compile-sizes": Flag("str"),
    "--piecewise-compiler": Flag("str", choices=("eager", "inductor")),
    "--piecewise-max-tokens": Flag("int", lo=1),
    "--piecewise-split-ops": Flag("str"),
    "--port": Flag("int", lo=0, hi=65535),
    "--prefix-cache-salt-per-key": Flag(None),
    "--quantization": Flag(
        "str", choices=("auto", "none", "fp8", "compressed-tensors", "awq", "gptq")
    ),
    "--request-read-timeout": Flag("float", lo=0, lo_exclusive=True),
    "--seed": Flag("int"),
    "--served-model-name": Flag("str", many=True),
    "--speculative-disable-by-batch-size": Flag("int", lo=1),
    "--speculative-method": Flag("str", choices=("ngram", "draft")),
    "--speculative-model": Flag("str"),
    "--speculative-placement": Flag("str", choices=("inprocess", "sidecar")),
    "--tensor-parallel-size": Flag("int", lo=1),
    "--tokenizer": Flag("str"),
    "--tool-call-parser": Flag("str", choices=("hermes", "llama3_json", "mistral")),
    "--watchdog-timeout": Flag("float", lo=0.0, lo_exclusive=True),
}
# END GENERATED

_PARSE = {"int": int, "float": float, "str": str}


def _value_error(flag: str, spec: Flag, raw: str) -> str | None:
    """Why ``raw`` is not a value ``flag`` takes, or None."""
    try:
        value = _PARSE[spec.value or "str"](raw)
    except ValueError:
        return f"{flag} takes {'an' if spec.value == 'int' else 'a'} {spec.value}, got {raw!r}"
    if spec.choices is not None and value not in spec.choices:
        allowed = ", ".join(map(str, spec.choices))
        return f"{flag} must be one of {allowed}, got {raw!r}"
    if spec.value == "str":
        return None
    return Bound(spec.lo, spec.hi, spec.lo_exclusive).refusal(flag, value)


def _is_value(item: str) -> bool:
    """Whether argparse would read ``item`` as a value, not as an option."""
    if not item.startswith("-"):
        return True
    try:
        float(item)  # a negative number
    except ValueError:
        return False
    return True


def extra_args_error(args: Sequence[str]) -> str | None:
    """Why ``kvscale serve`` would refuse these extra flags (each flag and each value one
    item), or None."""
    i = 0
    while i < len(args):
        flag = args[i]
        spec = FLAGS.get(flag)
        if spec is None:
            if _is_value(flag):
                return f"{flag!r} is not a flag: values follow the flag that takes them"
            return f"{flag} is not a kvscale serve flag (kvscale serve --help lists them)"
        i += 1
        if spec.value is None:
            continue
        values = []
        while i < len(args) and _is_value(args[i]) and (spec.many or not values):
            values.append(args[i])
            i += 1
        if not values:
            return f"{flag} needs a value"
        for raw in values:
            why = _value_error(flag, spec, raw)
            if why is not None:
                return why
    return None


# ---- generation (needs the server: torch) -----------------------------------------------------
def generate() -> dict[str, Flag]:
    """The table from the server's real ``kvscale serve`` parser and ``EngineConfig``."""
    import argparse
    from dataclasses import fields

    from kvscale.cli import build_parser
    from kvscale.server.api.launcher import FLAG_BOUNDS
    from kvscale.server.config import EngineConfig

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    engine = {"--" + f.name.replace("_", "-"): f.metadata for f in fields(EngineConfig)}
    table: dict[str, Flag] = {}
    for action in sub.choices["serve"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for opt in action.option_strings:
            if action.nargs == 0:
                table[opt] = Flag(None)
                continue
            kind = {int: "int", float: "float"}.get(action.type, "str")  # type: ignore[call-overload]
            meta = engine.get(opt) or {}
            choices = meta.get("choices") or action.choices
            bound = FLAG_BOUNDS.get(opt)
            table[opt] = Flag(
                kind,
                many=action.nargs == "+",
                choices=tuple(choices) if choices is not None else None,
                lo=bound.lo if bound else meta.get("min"),
                hi=bound.hi if bound else meta.get("max"),
                lo_exclusive=bound.lo_exclusive if bound else bool(meta.get("min_exclusive")),
            )
    return dict(sorted(table.items()))


def render(table: dict[str, Flag]) -> str:
    """``FLAGS`` as Python source, defaults left out."""
    lines = ["FLAGS: dict[str, Flag] = {"]
    defaults = Flag(None)
    for opt, spec in table.items():
        args = [repr(spec.value)]
        for name in ("many", "choices", "lo", "hi", "lo_exclusive"):
            v = getattr(spec, name)
            if v != getattr(defaults, name):
                args.append(f"{name}={v!r}")
        lines.append(f"    {opt!r}: Flag({', '.join(args)}),")
    lines.append("}")
    return "\n".join(lines)


def write(path: Path = Path(__file__)) -> None:
    """Rewrites the generated block of this module from the server."""
    text = path.read_text()
    begin = text.index("# BEGIN GENERATED")
    begin = text.index("\n", begin) + 1
    end = text.index("# END GENERATED")
    path.write_text(text[:begin] + render(generate()) + "\n" + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(render(generate()))
