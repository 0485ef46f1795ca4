"""The CRD: structural schema, subresources, printer columns, CEL rules; examples valid."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvscale.operator import constants as c
from kvscale.operator.spec import SpecError, parse_spec
from tests.k8s_emulator import jsonpath
from tests.k8s_emulator.schema import StructuralSchema
from tests.operator.conftest import EXAMPLES

BASE = {"model": {"source": "hf://org/model"}}
DRAFT = {"source": "hf://a/small"}


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version


def test_names_scope_and_subresources(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == c.CRD_NAME
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == (c.GROUP, "Namespaced")
    assert spec["names"]["kind"] == c.KIND and c.SHORT_NAME in spec["names"]["shortNames"]
    version = _version(crd)
    assert version["name"] == c.VERSION and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def _structural(schema: dict[str, Any], path: str = "") -> list[str]:
    """Nodes without a type (structural schemas need one, or int-or-string/preserve)."""
    bad = []
    if (
        "type" not in schema
        and not schema.get("x-kubernetes-int-or-string")
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        bad.append(path or "<root>")
    for key, sub in (schema.get("properties") or {}).items():
        bad += _structural(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            bad += _structural(schema[key], f"{path}[{key}]")
    return bad


def test_schema_is_structural_with_defaults(
    crd: dict[str, Any], crd_schema: StructuralSchema
) -> None:
    schema = _version(crd)["schema"]["openAPIV3Schema"]
    assert _structural(schema) == []
    spec = crd_schema.default({"spec": copy.deepcopy(BASE)})["spec"]
    assert spec["engine"]["tensorParallelSize"] == 1
    assert spec["autoscaling"]["targetKVCacheUtilizationPercent"] == 80
    assert spec["lifecycle"]["drainTimeoutSeconds"] == 120


def test_printer_columns_read_fields_the_schema_has(crd: dict[str, Any], make_llmd: Any) -> None:
    columns = {col["name"]: col for col in _version(crd)["additionalPrinterColumns"]}
    assert {"Model", "TP", "Ready", "Desired", "KV%", "Status", "Age"} <= set(columns)
    assert columns["Speculative"]["priority"] == 1  # kubectl get -o wide
    status = {
        "readyReplicas": 1,
        "desiredReplicas": 2,
        "kvCacheUsagePercent": 73,
        "conditions": [{"type": "Ready", "status": "False", "reason": "ReplicasNotReady"}],
    }
    obj = make_llmd(
        {
            "model": {"source": "hf://a/b"},
            "engine": {"tensorParallelSize": 2},
            "speculative": {"method": "ngram"},
        },
        **status,
    )
    obj["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    values = {name: jsonpath.evaluate(col["jsonPath"], obj) for name, col in columns.items()}
    assert values["Model"] == ["hf://a/b"] and values["TP"] == [2]
    assert values["Ready"] == [1] and values["Desired"] == [2] and values["KV%"] == [73]
    assert values["Status"] == ["ReplicasNotReady"] and values["Speculative"] == ["ngram"]
    plain = make_llmd({"model": {"source": "hf://a/b"}})
    assert jsonpath.evaluate(columns["Speculative"]["jsonPath"], plain) == []  # an empty cell


VALID = [
    {"engine": {"tensorParallelSize": 8}},
    {"engine": {"quantization": "fp8", "kvCacheDtype": "fp8", "prefixCaching": True}},
    {"engine": {"quantization": "awq"}, "model": {"source": "hf://a/b", "dtype": "float16"}},
    {"engine": {"quantization": "gptq"}, "model": {"source": "hf://a/b", "dtype": "bfloat16"}},
    {"engine": {"quantization": "awq", "kvCacheDtype": "fp8"}},
    {"engine": {"device": "cpu"}},
    {"engine": {"device": "cpu", "quantization": "fp8", "kvCacheDtype": "fp8"}},
    {"engine": {"device": "cpu", "tensorParallelSize": 2}},  # gloo ranks, as the server runs
    {"engine": {"device": "cpu", "quantization": "awq"}},
    {"speculative": {"method": "draft", "draftModel": DRAFT, "numSpeculativeTokens": 4}},
    {"speculative": {"method": "draft", "draftModel": DRAFT}},  # 4 tokens, sidecar
    {"speculative": {"method": "draft", "draftModel": DRAFT, "resources": {"gpus": 0}}},
    {"speculative": {"method": "draft", "draftModel": DRAFT, "placement": "inprocess"}},
    {"speculative": {"method": "ngram"}},
    {"speculative": {"method": "ngram", "ngram": {"min": 4}}},  # the default max is 4
    {"speculative": {"method": "ngram", "ngram": {"max": 2}}},  # the default min is 2
    {
        "speculative": {
            "method": "ngram",
            "numSpeculativeTokens": 16,
            "ngram": {"min": 1, "max": 16},
            "disableByBatchSize": 1,
        }
    },
    {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 2}},
    {"router": {"enabled": True}},
    {
        "router": {
            "enabled": True,
            "replicas": 2,
            "policy": "least-loaded",
            "holdTimeoutSeconds": 600,
        }
    },
    {"router": {"enabled": True, "resources": {"cpu": "500m", "memory": "1Gi"}}},
    {  # scale to zero: needs the router and the autoscaler
        "router": {"enabled": True},
        "autoscaling": {"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 60},
    },
    {"engine": {"extraArgs": ["--enforce-eager", "--seed", "3"]}},
    {"model": {"source": "s3://bucket/prefix", "credentialsSecretRef": {"name": "s3"}}},
]
INVALID = [
    ({"engine": {"tensorParallelSize": 3}}, "power of two"),
    ({"engine": {"tensorParallelSize": 6}}, "power of two"),
    ({"engine": {"tensorParallelSize": 16}}, "less than or equal to 8"),
    (
        {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        "minReplicas must be less than or equal",
    ),
    ({"speculative": {"draftModel": DRAFT}}, "spec.speculative.method: Required value"),
    ({"speculative": {"method": "eagle"}}, "Unsupported value"),
    ({"speculative": {"method": "draft"}}, "draftModel is required when method is draft"),
    (
        {"speculative": {"method": "ngram", "draftModel": DRAFT}},
        "draftModel applies to method draft only",
    ),
    (
        {"speculative": {"method": "ngram", "numSpeculativeTokens": 0}},
        "greater than or equal to 1",
    ),
    (
        {"speculative": {"method": "draft", "draftModel": DRAFT, "numSpeculativeTokens": 17}},
        "less than or equal to 16",
    ),
    (
        {"speculative": {"method": "ngram", "ngram": {"min": 5, "max": 3}}},
        "ngram.min must be <= ngram.max",
    ),
    (
        {"speculative": {"method": "ngram", "ngram": {"min": 5}}},  # the default max is 4
        "ngram.min must be <= ngram.max",
    ),
    ({"speculative": {"method": "ngram", "ngram": {"max": 1}}}, "ngram.min must be <= ngram.max"),
    ({"speculative": {"method": "ngram", "ngram": {"max": 17}}}, "less than or equal to 16"),
    (
        {"speculative": {"method": "ngram", "placement": "sidecar"}},
        "placement applies to method draft only",
    ),
    (
        {"speculative": {"method": "draft", "draftModel": DRAFT, "ngram": {"min": 2}}},
        "ngram applies to method ngram only",
    ),
    (
        {"speculative": {"method": "ngram", "resources": {"gpus": 1}}},
        "resources are the draft sidecar's",
    ),
    (
        {
            "speculative": {
                "method": "draft",
                "draftModel": DRAFT,
                "placement": "inprocess",
                "resources": {"memory": "8Gi"},
            }
        },
        "resources are the draft sidecar's",
    ),
    (
        {"speculative": {"method": "draft", "draftModel": DRAFT, "placement": "remote"}},
        "Unsupported value",
    ),
    (
        {"speculative": {"method": "ngram", "disableByBatchSize": 0}},
        "greater than or equal to 1",
    ),
    ({"engine": {"kvCacheDtype": "fp8_e5m2"}}, "Unsupported value"),
    ({"engine": {"quantization": "int4"}}, "Unsupported value"),
    ({"engine": {"extraArgs": ["--tensor-parallel-size=2"]}}, "extraArgs must not"),
    ({"model": {"source": "ftp://x/y"}}, "should match"),
    (
        {"model": {"source": "pvc://claim/x", "credentialsSecretRef": {"name": "s"}}},
        "hf:// and s3://",
    ),
    ({"replicas": -1}, "greater than or equal to 0"),
    ({"autoscaling": {"enabled": True, "minReplicas": 0}}, "needs autoscaling.enabled and router"),
    (
        {"router": {"enabled": True}, "autoscaling": {"minReplicas": 0}},
        "needs autoscaling.enabled and router",
    ),
    ({"router": {"enabled": True, "policy": "round-robin"}}, "Unsupported value"),
    ({"router": {"enabled": True, "replicas": 0}}, "greater than or equal to 1"),
    (
        {"router": {"enabled": True}, "autoscaling": {"enabled": True, "minReplicas": -1}},
        "greater than or equal to 0",
    ),
]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def _server_verdict(crd_schema: StructuralSchema, spec: dict[str, Any]) -> list[str]:
    obj = crd_schema.default(
        {"apiVersion": "x", "kind": "LLMDeployment", "metadata": {"name": "ok"}, "spec": spec}
    )
    return [str(cause) for cause in crd_schema.validate(obj)]


@pytest.mark.parametrize("extra", VALID)
def test_valid_specs_pass_the_server_and_the_operator(
    crd_schema: StructuralSchema, extra: dict
) -> None:
    spec = _merge(BASE, extra)
    assert _server_verdict(crd_schema, spec) == []
    parse_spec(spec)


@pytest.mark.parametrize(("extra", "message"), INVALID)
def test_invalid_specs_fail_on_the_server_and_in_the_operator(
    crd_schema: StructuralSchema, extra: dict, message: str
) -> None:
    spec = _merge(BASE, extra)
    causes = _server_verdict(crd_schema, spec)
    assert causes and any(message in cause for cause in causes), causes
    with pytest.raises(SpecError):
        parse_spec(spec)


def test_name_must_work_as_a_service_name(crd_schema: StructuralSchema) -> None:
    obj = {"metadata": {"name": "Llama_3"}, "spec": BASE}
    causes = crd_schema.validate(crd_schema.default(obj))
    assert any("Service name" in str(cause) for cause in causes)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(crd_schema: StructuralSchema, path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] != c.KIND:
            continue
        pruned, unknown = crd_schema.prune(doc)
        assert unknown == []
        assert crd_schema.validate(crd_schema.default(pruned)) == []
        parse_spec(doc["spec"])


def test_examples_cover_the_documented_cases() -> None:
    specs = [yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES]
    assert any(s.get("engine", {}).get("tensorParallelSize") == 2 for s in specs)
    assert any(
        s.get("engine", {}).get("prefixCaching") and s["engine"].get("quantization") == "fp8"
        for s in specs
    )
    methods = [(s.get("speculative") or {}).get("method") for s in specs]
    assert "draft" in methods and "ngram" in methods
    assert any(
        (s.get("router") or {}).get("enabled") and s["autoscaling"].get("minReplicas") == 0
        for s in specs
    )
