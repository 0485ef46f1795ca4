"""``native_build``: a C module built once into the cache and loaded; no compiler, a
failing build or ``KVSCALE_NATIVE=0`` give None (the callers' Python path), logged."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvscale.server import native_build

TINY = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *twice(PyObject *self, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(2 * v);
}
static PyMethodDef methods[] = {{"twice", twice, METH_O, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, methods};
PyMODINIT_FUNC PyInit_tiny(void) { return PyModule_Create(&module); }
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSCALE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSCALE_NATIVE", "1")
    monkeypatch.setattr(native_build, "_loaded", {})
    return tmp_path / "cache" / "native"


def test_builds_once_then_loads_from_the_cache(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "tiny.c"
    src.write_text(TINY)
    mod = native_build.load("tiny", src)
    assert mod is not None and mod.twice(21) == 42
    (built,) = cache.iterdir()  # one file, no temporary left behind
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(native_build, "_loaded", {})  # a new process, as far as it knows
    again = native_build.load("tiny", src)
    assert again is not None and again.twice(2) == 4 and built.stat().st_mtime_ns == stamp
    src.write_text(TINY.replace("2 * v", "3 * v"))  # another source: another build
    monkeypatch.setattr(native_build, "_loaded", {})
    third = native_build.load("tiny", src)
    assert third is not None and third.twice(2) == 6 and len(list(cache.iterdir())) == 2


def test_without_a_build_the_caller_gets_none_and_a_reason(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C")
    with caplog.at_level(logging.WARNING):
        assert native_build.load("broken", broken) is None
    assert "broken: the build failed" in caplog.text and "Python path" in caplog.text
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-written kept
    src = tmp_path / "tiny.c"
    src.write_text(TINY)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING):
        assert native_build.load("tiny", src) is None
    assert "no C compiler" in caplog.text
    monkeypatch.setenv("PATH", os.defpath)
    monkeypatch.setenv("KVSCALE_NATIVE", "0")
    assert native_build.load("other", src) is None  # off: not even tried
    assert "other" not in native_build._loaded
