"""The demo checkpoint's cache: built once, never torn down under a process using it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvscale.server import demo_model


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Points the cache at ``tmp_path`` and replaces the (seconds-long) build with one that
    writes a marked config; returns the folders built, in order."""
    monkeypatch.setenv("KVSCALE_CACHE", str(tmp_path))
    built: list[Path] = []

    def fake_build(out: Path, **kwargs: Any) -> Path:
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"built_by": os.getpid(), "n": len(built)}))
        built.append(out)
        return out

    monkeypatch.setattr(demo_model, "build_checkpoint", fake_build)
    return built


def test_built_once_then_cached(builds: list[Path], tmp_path: Path) -> None:
    path = demo_model.demo_model_path()
    assert path == tmp_path / "demo-llama-demo-v1"
    assert demo_model.demo_model_path() == path
    assert len(builds) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp folder left


def test_a_finished_copy_from_another_process_is_kept(
    builds: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server finished first while this one was building: its folder (which it
    may be reading) stays as it is, and this process's copy is dropped."""
    final = tmp_path / "demo-llama-demo-v1"
    build = demo_model.build_checkpoint

    def racing_build(out: Path, **kwargs: Any) -> Path:
        build(out, **kwargs)
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')
        (final / "tokenizer.json").write_text("{}")
        return out

    monkeypatch.setattr(demo_model, "build_checkpoint", racing_build)
    path = demo_model.demo_model_path()
    assert path == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert (final / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_a_stale_partial_folder_is_replaced(builds: list[Path], tmp_path: Path) -> None:
    final = tmp_path / "demo-llama-demo-v1"
    final.mkdir()
    (final / "tokenizer.json").write_text("{}")  # an interrupted build of an older version
    path = demo_model.demo_model_path()
    assert json.loads((path / "config.json").read_text())["n"] == 0
    assert not (path / "tokenizer.json").exists()
