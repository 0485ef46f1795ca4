"""The scripts under ``bench/`` (not a package) as modules, for their CPU tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(stem: str) -> ModuleType:
    """``bench/<stem>.py``, loaded once as module ``bench_<stem>`` (registered in
    ``sys.modules`` before it runs: dataclasses look their module up there)."""
    name = f"bench_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
