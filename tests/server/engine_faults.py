"""Engine-process entry points with faults, for tests (importable in a spawned process)."""

from __future__ import annotations

from typing import Any

from kvscale.server.engine.engine_core import EngineCore
from kvscale.server.process.engine_process import run_engine_process


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


class InstantCore:
    """Stands in for EngineCore with no model: every step emits one token for every
    running sequence after ``step_s`` seconds, and ends each at its ``max_tokens``. It
    floods the API process with step messages as a fast GPU does at high concurrency."""

    step_s = 0.002
    token_id = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        from kvscale.server.engine.block_manager import BlockManager

        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.block_manager = BlockManager(1024, 16)
        self.active: dict[str, list[int]] = {}  # request id -> [tokens left, tokens done]
        self.steps = 0

    def add_request(
        self, rid: str, prompt_ids: list[int], params: Any, arrival: Any, salt: Any = None
    ) -> None:
        self.active[rid] = [params.max_tokens or 16, 0]

    def abort_request(self, rid: str) -> bool:
        return self.active.pop(rid, None) is not None

    def finish_sequence(self, rid: str, index: int) -> None:
        self.active.pop(rid, None)

    def take_refused(self) -> list[tuple[str, str]]:
        return []  # no grammars here: nothing is ever refused after queueing

    def abort_all(self) -> list[str]:
        rids = list(self.active)
        self.active.clear()
        return rids

    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> list[Any]:
        import time

        from kvscale.server.engine.core_outputs import SeqUpdate

        time.sleep(self.step_s)
        self.steps += 1
        now = time.monotonic()
        updates = []
        for rid, state in list(self.active.items()):
            state[0] -= 1
            state[1] += 1
            done = state[0] <= 0
            if done:
                del self.active[rid]
            first = now if state[1] == 1 else None
            updates.append(
                SeqUpdate(rid, 0, self.token_id, None, "length" if done else None, None, first)
            )
        return updates

    def stats(self) -> Any:
        from kvscale.server.engine.core_outputs import EngineStats

        return EngineStats(len(self.active), 0, 1024, 1024, 0.0, 0, 0, 0)


def run_instant_engine(*args: Any) -> None:
    """The real engine process loop around ``InstantCore`` (no model)."""
    import kvscale.server.process.engine_process as ep

    ep.EngineCore = InstantCore  # type: ignore[misc,assignment]
    ep.run_engine_process(*args)
