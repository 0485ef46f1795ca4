"""Fixtures for the operator, CRD, chart and emulator tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s_emulator.schema import StructuralSchema

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "llmdeployments.serving.kvscale.dev.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> StructuralSchema:
    return StructuralSchema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="session")
def make_llmd(crd_schema: StructuralSchema) -> Callable[..., dict[str, Any]]:
    """``make_llmd(spec, name=..)`` -> an LLMDeployment as the API server stores it
    (defaulted by the CRD), with the metadata the operator reads."""

    def make(spec: dict[str, Any], name: str = "demo", namespace: str = "ml", **status: Any):
        body = {
            "apiVersion": "serving.kvscale.dev/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{name}",
                "generation": 1,
            },
            "spec": copy.deepcopy(spec),
        }
        body = crd_schema.default(body)
        causes = crd_schema.validate(body)
        assert not causes, causes
        if status:
            body["status"] = status
        return body

    return make
