"""C extension modules of this package, compiled at first use (as Triton builds its
launchers, so a machine that runs the Triton kernels has what this needs: a C compiler
and Python's headers).

``load(name, source)`` returns the module, or None (logged once) when there is no
compiler, the build fails, or ``KVSCALE_NATIVE=0``; the callers then run their Python
path, which gives the same results. Builds live under ``$KVSCALE_CACHE/native`` (default
``~/.cache/kvscale/native``), named by a hash of the source, the Python build and numpy's
version; a build is written to a temporary file and renamed, so concurrent processes
never load a half-written one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np

log = logging.getLogger(__name__)

_loaded: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """Whether native modules may be used (``KVSCALE_NATIVE=0`` turns them off)."""
    return os.environ.get("KVSCALE_NATIVE", "1") != "0"


def cache_dir() -> Path:
    base = os.environ.get("KVSCALE_CACHE") or Path.home() / ".cache" / "kvscale"
    return Path(base) / "native"


def compiler() -> str | None:
    """``$CC``, else gcc, cc or clang on the PATH."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return next((p for c in ("gcc", "cc", "clang") if (p := shutil.which(c))), None)


def _build_key(source: bytes) -> str:
    h = hashlib.sha256(source)
    for part in (sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", np.__version__,
                 platform.machine()):  # fmt: skip
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compile(cc: str, src: Path, out: Path) -> None:
    include = sysconfig.get_paths()["include"]
    tmp = tempfile.NamedTemporaryFile(dir=out.parent, suffix=out.suffix, delete=False)
    tmp.close()
    cmd = [cc, str(src), "-O2", "-shared", "-fPIC", "-o", tmp.name,
           f"-I{include}", f"-I{np.get_include()}"]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp.name, out)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)


def load(name: str, source: Path) -> ModuleType | None:
    """The extension module ``name`` (its C init function ``PyInit_<name>``) built from
    ``source``; None when it cannot be had (the reason logged once per process)."""
    if not enabled():
        return None
    if name in _loaded:
        return _loaded[name]
    mod: ModuleType | None = None
    if (cc := compiler()) is None:
        log.warning("native %s: no C compiler (gcc, cc, clang or $CC): the Python path runs",
                    name)  # fmt: skip
    else:
        try:
            text = source.read_bytes()
            out = cache_dir() / f"{name}-{_build_key(text)}{sysconfig.get_config_var('EXT_SUFFIX')}"
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                _compile(cc, source, out)
            spec = importlib.util.spec_from_file_location(name, out)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except (OSError, subprocess.SubprocessError, ImportError) as e:
            detail = getattr(e, "stderr", "") or ""
            log.warning("native %s: the build failed (%s) %s: the Python path runs",
                        name, e, detail[-2000:])  # fmt: skip
            mod = None
    _loaded[name] = mod
    return mod
