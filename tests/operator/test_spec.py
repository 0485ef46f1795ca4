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
            "spec.speculative.method",
            "is required: draft (a draft model proposes the tokens) or ngram",
        ),
        (
            {"model": {"source": "hf://a/b"}, "speculative": {"method": "eagle"}},
            "spec.speculative.method",
            "must be one of draft, ngram (got 'eagle')",
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


DRAFT = {"source": "hf://org/small"}


def _speculative(**speculative: Any) -> dict[str, Any]:
    return {"model": {"source": "hf://org/big"}, "speculative": speculative}


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "draft", "draftModel": DRAFT},
        {"method": "draft", "draftModel": DRAFT, "resources": {"memory": "8Gi"}},
        {"method": "draft", "draftModel": DRAFT, "placement": "inprocess"},
        {"method": "ngram", "ngram": {"max": 6}},
    ],
)
def test_speculative_defaults_match_the_crd(
    crd_schema: StructuralSchema, speculative: dict[str, Any]
) -> None:
    raw = _speculative(**speculative)
    assert parse_spec(raw) == parse_spec(crd_schema.default({"spec": raw})["spec"])


def test_speculative_defaults_per_method() -> None:
    draft = parse_spec(_speculative(method="draft", draftModel=DRAFT)).speculative
    assert draft is not None
    assert (draft.method, draft.placement, draft.num_speculative_tokens) == ("draft", "sidecar", 4)
    assert draft.sidecar and draft.resources.gpus == 1 and draft.draft_model is not None
    assert (draft.ngram_min, draft.ngram_max, draft.disable_by_batch_size) == (None, None, None)
    inproc = parse_spec(_speculative(method="draft", draftModel=DRAFT, placement="inprocess"))
    assert inproc.speculative is not None and not inproc.speculative.sidecar
    ngram = parse_spec(
        _speculative(
            method="ngram", numSpeculativeTokens=16, ngram={"min": 3}, disableByBatchSize=8
        )
    ).speculative
    assert ngram is not None and ngram.draft_model is None and ngram.placement is None
    assert not ngram.sidecar
    assert (ngram.num_speculative_tokens, ngram.ngram_min, ngram.ngram_max) == (16, 3, None)
    assert ngram.disable_by_batch_size == 8


@pytest.mark.parametrize(
    ("speculative", "field", "words"),
    [
        ({"method": "draft"}, "spec.speculative.draftModel", "is required when method is draft"),
        (
            {"method": "ngram", "draftModel": DRAFT},
            "spec.speculative.draftModel",
            "applies to method draft only; method ngram drafts from the prompt and output",
        ),
        (
            {"method": "ngram", "placement": "sidecar"},
            "spec.speculative.placement",
            "applies to method draft only",
        ),
        (
            {"method": "ngram", "resources": {"gpus": 1}},
            "spec.speculative.resources",
            "method ngram has no sidecar",
        ),
        (
            {"method": "draft", "draftModel": DRAFT, "placement": "inprocess", "resources": {}},
            "spec.speculative.resources",
            "with placement inprocess the draft shares the server container's GPUs",
        ),
        (
            {"method": "draft", "draftModel": DRAFT, "ngram": {"min": 2}},
            "spec.speculative.ngram",
            "applies to method ngram only",
        ),
        (
            {"method": "draft", "draftModel": DRAFT, "placement": "remote"},
            "spec.speculative.placement",
            "must be one of sidecar, inprocess (got 'remote')",
        ),
        (
            {"method": "ngram", "numSpeculativeTokens": 0},
            "spec.speculative.numSpeculativeTokens",
            "must be between 1 and 16 (got 0)",
        ),
        (
            {"method": "draft", "draftModel": DRAFT, "numSpeculativeTokens": 17},
            "spec.speculative.numSpeculativeTokens",
            "must be between 1 and 16 (got 17)",
        ),
        (
            {"method": "ngram", "ngram": {"min": 5, "max": 3}},
            "spec.speculative.ngram",
            "min (5) must be <= max (3)",
        ),
        (
            {"method": "ngram", "ngram": {"min": 5}},
            "spec.speculative.ngram",
            "min (5) must be <= max (4); an unset min is 2 and an unset max 4",
        ),
        (
            {"method": "ngram", "ngram": {"max": 17}},
            "spec.speculative.ngram.max",
            "must be between 1 and 16 (got 17)",
        ),
        (
            {"method": "ngram", "disableByBatchSize": 0},
            "spec.speculative.disableByBatchSize",
            "must be between 1 and 65536 (got 0)",
        ),
        (
            {"method": "draft", "draftModel": {"source": "ftp://x/y"}},
            "spec.speculative.draftModel.source",
            "must be hf://org/name",
        ),
    ],
)
def test_speculative_errors_name_the_field(
    speculative: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_speculative(**speculative))
    assert str(err.value).startswith(f"{field}: ") and words in str(err.value), str(err.value)
