"""Engine-process entry points with faults, for tests (importable in a spawned process)."""

from __future__ import annotations

from typing import Any

from kvscale.server.engine.engine_core import EngineCore
from kvscale.server.engine_process import run_engine_process


def run_with_failing_third_step(*args: Any) -> None:
    """The real engine process, except that its third step raises RuntimeError("boom")."""
    real_step = EngineCore.step
    calls = {"n": 0}

    def flaky_step(self: EngineCore) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step(self)

    EngineCore.step = flaky_step  # type: ignore[method-assign]
    run_engine_process(*args)


def run_failing_to_load(*args: Any) -> None:
    """An engine process whose model cannot load."""
    raise_in_load = RuntimeError("cannot load: out of memory (simulated)")

    def broken_init(self: EngineCore, *a: Any, **kw: Any) -> None:
        raise raise_in_load

    EngineCore.__init__ = broken_init  # type: ignore[method-assign]
    run_engine_process(*args)
