"""The distribution's layout: kvscale.{server,kernels,operator,router}; no top-level
shadows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_subpackages_map_to_top_level_folders(tmp_path: Path) -> None:
    code = (
        "import importlib.util, kvscale.server, kvscale.kernels, kvscale.operator, operator\n"
        "import kvscale.router\n"
        "print(kvscale.server.__file__); print(kvscale.kernels.__file__)\n"
        "print(kvscale.operator.__file__); print(operator.__file__)\n"
        "print([n for n in ('server', 'kernels', 'router') if importlib.util.find_spec(n)])\n"
        "print(kvscale.router.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == str(ROOT / "server" / "__init__.py")
    assert out[1] == str(ROOT / "kernels" / "__init__.py")
    assert out[2] == str(ROOT / "operator" / "__init__.py")
    assert "lib" in out[3] and str(ROOT) not in out[3]  # the stdlib operator module
    assert out[4] == "[]"
    assert out[5] == str(ROOT / "router" / "__init__.py")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci
    assert "make test" in readme


def test_every_code_folder_is_a_regular_package() -> None:
    """find_packages (setup.py) skips folders without __init__.py: a wheel install (the
    images) would lack them although an editable install imports them as namespaces."""
    missing = [
        str(d.relative_to(ROOT))
        for top in ("kvscale", "server", "kernels", "operator", "router")
        for d in [ROOT / top, *(ROOT / top).rglob("*")]
        if d.is_dir()
        and "__pycache__" not in d.parts
        and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    ]
    assert not missing
