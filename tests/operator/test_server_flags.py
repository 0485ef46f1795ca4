"""The operator's table of ``kvscale serve`` flags against the server itself.

``kvscale.operator.server_flags`` lets the operator refuse extraArgs the server would
refuse, without torch. These tests check the table against the server's real parser,
``EngineConfig`` and launcher: the table is what they generate, and for every flag an
extraArgs item may name, the table and the server refuse the same values.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvscale.operator import admission, server_flags
from kvscale.operator.server_flags import Flag, extra_args_error
from kvscale.operator.spec import SpecError, parse_spec
from tests.operator.test_admission import server_refusal

BASE = ["serve", "--model", "/nowhere"]


def test_the_table_is_what_the_server_generates() -> None:
    assert server_flags.generate() == server_flags.FLAGS, (
        "the server's flags changed: run python -m kvscale.operator.server_flags --write, "
        "then ruff format operator/server_flags.py"
    )


def _extra_flags() -> list[str]:
    """The flags an extraArgs item may name (not managed by the operator)."""
    return [f for f in server_flags.FLAGS if admission.smuggled_flag(f) is None]


def _probes(spec: Flag) -> list[str]:
    if spec.choices is not None:
        return [*map(str, spec.choices), "nonsense", "0", "7"]
    if spec.value == "int":
        return ["-1", "0", "1", "2", "16", "17", "1023", "1024", "65535", "65536", "x", "1.5"]
    if spec.value == "float":
        return ["-1", "0", "0.5", "1", "1.5", "1e9", "nan", "x"]
    return []


CROSS_CHECKED = {
    # values the server refuses only with other flags: the table says nothing of them
    "--piecewise-capture-sizes",
    "--piecewise-compile-sizes",
    "--piecewise-split-ops",
    "--chat-template",  # a file in the pod
}


@pytest.mark.parametrize("flag", _extra_flags())
def test_the_table_and_the_server_refuse_the_same_values(flag: str) -> None:
    spec = server_flags.FLAGS[flag]
    if spec.value is None:
        assert extra_args_error([flag]) is None and server_refusal([*BASE, flag]) is None
        assert extra_args_error([flag, "x"]) is not None  # a switch takes no value
        return
    assert extra_args_error([flag]) == f"{flag} needs a value"
    assert server_refusal([*BASE, flag]) is not None
    for value in _probes(spec):
        ours = extra_args_error([flag, value])
        theirs = server_refusal([*BASE, flag, value])
        assert (ours is None) == (theirs is None), (flag, value, ours, theirs)
    if spec.value == "str" and spec.choices is None and flag not in CROSS_CHECKED:
        assert extra_args_error([flag, "anything"]) is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--bogus"], "--bogus is not a kvscale serve flag"),
        (["--cuda-graph-mode", "fast"], "--cuda-graph-mode must be one of auto, full_and"),
        (["--seed", "three"], "--seed takes an int, got 'three'"),
        (["--seed"], "--seed needs a value"),
        (["--seed", "--enforce-eager"], "--seed needs a value"),
        (["3"], "'3' is not a flag"),
        (["--enforce-eager", "yes"], "'yes' is not a flag"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1, got 0"),
        (["--max-header-bytes", "512"], "--max-header-bytes must be >= 1024, got 512"),
        (["--watchdog-timeout", "0"], "--watchdog-timeout must be > 0.0, got 0.0"),
        (["--engine-stall-timeout", "nan"], "--engine-stall-timeout must be a number"),
    ],
)
def test_bad_extra_args_are_refused_with_the_reason(extra: list[str], message: str) -> None:
    assert message in (extra_args_error(extra) or ""), extra_args_error(extra)
    assert server_refusal([*BASE, *extra]) is not None  # and the server would refuse them
    with pytest.raises(SpecError, match=r"spec\.engine\.extraArgs"):
        parse_spec({"model": {"source": "builtin://demo"}, "engine": {"extraArgs": extra}})


def test_good_extra_args_pass() -> None:
    extra: list[Any] = [
        "--cuda-graph-mode",
        "auto",
        "--seed",
        "-3",
        "--enforce-eager",
        "--watchdog-timeout",
        "1e3",
        "--log-level",
        "debug",
    ]
    assert extra_args_error(extra) is None
    assert server_refusal([*BASE, *extra]) is None
    parse_spec({"model": {"source": "builtin://demo"}, "engine": {"extraArgs": extra}})


def test_the_operator_imports_no_torch() -> None:
    """Its image has none: the table is read without the server."""
    import subprocess
    import sys

    code = (
        "import sys, kvscale.operator.handlers, kvscale.operator.server_flags; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
