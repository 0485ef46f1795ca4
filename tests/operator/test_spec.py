"""Typed spec parsing: defaults equal the CRD's, errors name the field."""

from __future__ import annotations

from typing import Any

import pytest

from kvscale.operator.spec import SpecError, desired_replicas, parse_spec
from tests.k8s_emulator.schema import StructuralSchema


def test_defaults_match_the_crd(crd_schema: StructuralSchema) -> None:
    raw = {"model": {"source": "hf://Qwen/Qwen2.5-1.5B-Instruct"}}
    defaulted = crd_schema.default({"spec": raw})["spec"]
    assert parse_spec(raw) == parse_spec(defaulted)
    spec = parse_spec(raw)
    assert spec.engine.tensor_parallel_size == 1 and spec.engine.device == "cuda"
    assert spec.model.served_model_name == "Qwen/Qwen2.5-1.5B-Instruct"
    assert spec.replicas == 1 and not spec.autoscaling.enabled
    assert spec.gpus_per_replica == 1
    assert spec.service.port == 8000 and spec.service.type == "ClusterIP"


@pytest.mark.parametrize(
    ("source", "scheme", "name"),
    [
        ("hf://org/name", "hf", "org/name"),
        ("pvc://models/llama/8b", "pvc", "8b"),
        ("pvc://models", "pvc", "models"),
        ("s3://bucket/prefix/llama-8b/", "s3", "llama-8b"),
        ("builtin://demo", "builtin", "demo"),
    ],
)
def test_sources(source: str, scheme: str, name: str) -> None:
    spec = parse_spec({"model": {"source": source}})
    assert spec.model.source.scheme == scheme
    assert spec.model.served_model_name == name


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ({}, "spec.model", "required"),
        ({"model": {"source": "http://x"}}, "spec.model.source", "hf://org/name"),
        (
            {"model": {"source": "hf://a/b"}, "engine": {"tensorParallelSize": 3}},
            "tensorParallelSize",
            "1, 2, 4 or 8",
        ),
        (
            {"model": {"source": "hf://a/b"}, "engine": {"tensorParallelSize": 16}},
            "tensorParallelSize",
            "between 1 and 8",
        ),
        (
            {"model": {"source": "hf://a/b"}, "engine": {"quantization": "int4"}},
            "quantization",
            "none, fp8, awq, gptq",
        ),
        (
            {"model": {"source": "hf://a/b"}, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            "spec.autoscaling",
            "minReplicas (5) must be <= maxReplicas (2)",
        ),
        (
            {
                "model": {"source": "hf://a/b"},
                "speculative": {"draftModel": {"source": "hf://c/d"}},
            },
            "numSpeculativeTokens",
            "required",
        ),
        (
            {"model": {"source": "hf://a/b"}, "engine": {"extraArgs": ["--port", "9000"]}},
            "extraArgs",
            "could set --port, which the operator sets",
        ),
        ({"model": {"source": "pvc://m/x", "revision": "v1"}}, "revision", "hf:// sources only"),
        (
            {"model": {"source": "hf://a/b"}, "resources": {"memory": "lots"}},
            "spec.resources.memory",
            "quantity",
        ),
    ],
)
def test_errors_name_the_field(raw: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert field in str(err.value) and words in str(err.value)


def test_desired_replicas_follows_spec_then_the_autoscaler() -> None:
    spec = parse_spec({"model": {"source": "hf://a/b"}, "replicas": 3})
    assert desired_replicas(spec) == 3
    auto = parse_spec(
        {
            "model": {"source": "hf://a/b"},
            "replicas": 9,
            "autoscaling": {"enabled": True, "maxReplicas": 5},
        }
    )
    assert desired_replicas(auto) == 5  # clamped
    # the operator's own status.desiredReplicas is not a decision; the autoscaler's is
    assert desired_replicas(auto, {"desiredReplicas": 2}) == 5
    decided = {"desiredReplicas": 2, "lastScaleTime": "2026-01-01T00:00:00Z"}
    assert desired_replicas(auto, decided) == 2
