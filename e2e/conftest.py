"""End-to-end tests on a real cluster (kind or k3d): run only when KUBECONFIG points at one.

    make e2e    # see the README: build both images, load them into the cluster, then this

Images come from KVSCALE_E2E_SERVER_IMAGE / KVSCALE_E2E_OPERATOR_IMAGE (default
kvscale-server:e2e and kvscale-operator:e2e, loaded with `kind load docker-image`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KUBECTL = (
    str(Path(sys.executable).parent / "kubectl")
    if (Path(sys.executable).parent / "kubectl").exists()
    else shutil.which("kubectl")
)


def _cluster_problem() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return "KUBECONFIG is not set: the e2e tests need a real cluster (kind or k3d)"
    if KUBECTL is None:
        return "no kubectl found"
    try:
        proc = subprocess.run(
            [KUBECTL, "version", "-o", "json"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"kubectl cannot reach the cluster: {e}"
    if proc.returncode != 0 or "serverVersion" not in proc.stdout:
        return f"the cluster in KUBECONFIG is not reachable: {proc.stderr.strip()[:200]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [item for item in items if item.path.is_relative_to(here)]
    problem = _cluster_problem() if mine else None
    if problem:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=problem))
