"""The CRD, the operator and the server agree on what an LLMDeployment may ask for (#14).

``kvscale.operator.admission`` states the limits once; these tests check that table
against the CRD (schema bounds, patterns, CEL rules, evaluated by the emulator's validator:
jsonschema with RE2 patterns and cel-python) and against the server's real flag parser and
``EngineConfig``: every spec the CRD and the operator accept renders flags the server
starts with, and both refuse the same hostile specs. A new bounded field goes into
``admission.BOUNDS`` and is checked here without new test code.
"""

from __future__ import annotations

import argparse
import copy
import re
from typing import Any

import pytest
import re2

from kvscale.cli import build_parser
from kvscale.operator import admission
from kvscale.operator.config import OperatorConfig
from kvscale.operator.render import render_deployment, server_args
from kvscale.operator.spec import SpecError, parse_spec
from kvscale.server.api.launcher import check_flags
from tests.k8s_emulator.schema import StructuralSchema

BASE: dict[str, Any] = {"model": {"source": "builtin://demo"}}
SUBCOMMANDS = next(
    a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
).choices
SERVE = SUBCOMMANDS["serve"]
SERVER_FLAGS = {opt for action in SERVE._actions for opt in action.option_strings}


def _node(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.split("."):  # "spec.engine.x" -> properties.spec.properties...
        node = node["properties"][part]
    return node


def _crd_spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _set(spec: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    node = out
    parts = dotted.split(".")[1:]
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def crd_accepts(schema: StructuralSchema, spec: dict[str, Any]) -> list[str]:
    obj = schema.default(
        {"apiVersion": "x", "kind": "LLMDeployment", "metadata": {"name": "ok"}, "spec": spec}
    )
    return [str(c) for c in schema.validate(obj)]


def operator_accepts(schema: StructuralSchema, spec: dict[str, Any]) -> str | None:
    try:
        parse_spec(schema.default({"spec": copy.deepcopy(spec)})["spec"])
    except SpecError as e:
        return str(e)
    return None


def server_refusal(args: list[str]) -> str | None:
    """Why ``kvscale serve`` would refuse these flags at start (None: it starts)."""
    try:
        ns = build_parser().parse_args(args)
    except SystemExit:
        return "argument parser"
    try:
        check_flags(ns)
    except ValueError as e:
        return str(e)
    return None


# ---- bounds -------------------------------------------------------------------------------
def test_every_bound_is_in_the_crd(crd: dict[str, Any]) -> None:
    spec = {"properties": {"spec": _crd_spec_schema(crd)}}
    for path, bound in admission.BOUNDS.items():
        node = _node(spec, path)
        if bound.choices is not None and "enum" in node:
            assert tuple(node["enum"]) == bound.choices, path
        else:
            assert (node.get("minimum"), node.get("maximum")) == (bound.lo, bound.hi), path
        assert bound.flag in SERVER_FLAGS, f"{path}: {bound.flag} is not a server flag"


def _probe_values(bound: admission.Bound) -> list[Any]:
    if bound.choices is not None:
        values = [*bound.choices, 3, 6, 7, 256]
    else:
        assert bound.lo is not None and bound.hi is not None
        step = 1 if isinstance(bound.lo, int) and isinstance(bound.hi, int) else 0.01
        values = [bound.lo - step, bound.lo, bound.hi, bound.hi + step]
    if isinstance(bound.lo, float) or isinstance(bound.hi, float):
        return [round(float(v), 4) for v in values]
    return values


@pytest.mark.parametrize("path", sorted(admission.BOUNDS))
def test_crd_operator_and_server_agree_at_every_bound(
    crd_schema: StructuralSchema, path: str
) -> None:
    bound = admission.BOUNDS[path]
    for value in _probe_values(bound):
        spec = _set(BASE, path, value)
        crd_err = crd_accepts(crd_schema, spec)
        op_err = operator_accepts(crd_schema, spec)
        assert bool(crd_err) == bool(op_err), (path, value, crd_err, op_err)
        if crd_err:
            continue
        parsed = parse_spec(crd_schema.default({"spec": spec})["spec"])
        refusal = server_refusal(server_args(parsed))
        assert refusal is None, f"{path}={value} passes admission but the server refuses: {refusal}"


@pytest.mark.parametrize(
    ("engine", "words"),
    [
        ({"blockSize": 3}, "Unsupported value"),
        ({"maxQueueLen": 0}, "greater than or equal to 1"),
        ({"maxNumSeqs": 64, "maxNumBatchedTokens": 32}, "maxNumBatchedTokens must be >="),
    ],
)
def test_specs_that_crash_looped_are_refused_at_admission(
    crd_schema: StructuralSchema, engine: dict[str, Any], words: str
) -> None:
    spec = {**BASE, "engine": engine}
    assert any(words in e for e in crd_accepts(crd_schema, spec)), crd_accepts(crd_schema, spec)
    assert operator_accepts(crd_schema, spec) is not None
    ok = {**BASE, "engine": {k: v for k, v in engine.items() if k == "maxNumSeqs"}}
    assert server_refusal(server_args(parse_spec(crd_schema.default({"spec": ok})["spec"]))) is None


def test_max_num_batched_tokens_alone_caps_the_servers_default(
    crd_schema: StructuralSchema,
) -> None:
    # no maxNumSeqs: the server picks 256 or 1024 by GPU, at most maxNumBatchedTokens
    spec = {**BASE, "engine": {"maxNumBatchedTokens": 100}}
    assert crd_accepts(crd_schema, spec) == []
    assert operator_accepts(crd_schema, spec) is None
    args = server_args(parse_spec(crd_schema.default({"spec": spec})["spec"]))
    assert "--max-num-seqs" not in args
    assert server_refusal(args) is None


def test_replicas_and_context_have_maxima(crd_schema: StructuralSchema) -> None:
    for spec in (
        {**BASE, "replicas": admission.MAX_REPLICAS + 1},
        {**BASE, "autoscaling": {"maxReplicas": admission.MAX_REPLICAS + 1}},
        {**BASE, "model": {"source": "builtin://demo", "maxModelLen": (1 << 20) + 1}},
    ):
        assert crd_accepts(crd_schema, spec) and operator_accepts(crd_schema, spec)


# ---- flags: no smuggling through extraArgs -----------------------------------------------------
def test_the_server_parser_takes_no_abbreviation() -> None:
    for flag in admission.MANAGED_FLAGS:
        if flag.startswith("--no-"):
            continue
        short = flag[: len(flag) - 2]
        assert server_refusal(["serve", short, "x"]) == "argument parser", short


FULL: dict[str, Any] = {
    "model": {"source": "builtin://demo", "maxModelLen": 4096},
    "engine": {
        "blockSize": 32,
        "maxNumBatchedTokens": 8192,
        "maxQueueLen": 8,
        "tensorParallelSize": 2,
        "quantization": "fp8",
        "kvCacheDtype": "fp8",
        "prefixCaching": True,
    },
}
# Every speculative flag the operator renders, between them (issue 18's flag contract).
SPECULATIVE = [
    {"method": "draft", "draftModel": {"source": "builtin://demo"}, "disableByBatchSize": 8},
    {"method": "draft", "draftModel": {"source": "builtin://demo"}, "placement": "inprocess"},
    {"method": "ngram", "numSpeculativeTokens": 3, "ngram": {"min": 1, "max": 3}},
]


def _rendered_flags(crd_schema: StructuralSchema, spec: dict[str, Any]) -> set[str]:
    args = server_args(parse_spec(crd_schema.default({"spec": spec})["spec"]))
    return {a for a in args if a.startswith("--")}


def test_managed_flags_are_every_flag_the_operator_renders(crd_schema: StructuralSchema) -> None:
    rendered = set().union(
        *(_rendered_flags(crd_schema, {**FULL, "speculative": s}) for s in SPECULATIVE)
    )
    assert rendered <= set(admission.MANAGED_FLAGS), rendered - set(admission.MANAGED_FLAGS)
    assert set(admission.SPECULATIVE_FLAGS) <= rendered  # each one is rendered by some spec
    assert set(admission.MANAGED_FLAGS) - set(admission.SPECULATIVE_FLAGS) <= SERVER_FLAGS


def _needs_the_speculative_server() -> None:
    if "--speculative-method" not in SERVER_FLAGS:
        pytest.skip(
            "kvscale serve has no --speculative-method in this tree yet (issue 18's server "
            "side lands separately); the rendered flags follow its contract (test_render)"
        )


def test_speculative_flags_are_server_flags() -> None:
    _needs_the_speculative_server()
    assert set(admission.SPECULATIVE_FLAGS) <= SERVER_FLAGS


@pytest.mark.parametrize("speculative", SPECULATIVE)
def test_speculative_command_lines_parse(speculative: dict[str, Any]) -> None:
    """What the operator renders for the target and the draft sidecar is what the server's
    parsers take (choices, integer values); n-gram needs no file, so it must also start."""
    _needs_the_speculative_server()
    llmd = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
    parsed = parse_spec({**BASE, "engine": {"device": "cpu"}, "speculative": speculative})
    pod = render_deployment(llmd, parsed, OperatorConfig(), 1)["spec"]["template"]["spec"]
    for ctr in pod["containers"]:
        if ctr["args"][0] == "serve-draft" and "serve-draft" not in SUBCOMMANDS:
            pytest.skip("kvscale has no serve-draft subcommand in this tree yet (issue 18)")
        assert build_parser().parse_args(ctr["args"]).command == ctr["args"][0]
    if speculative["method"] == "ngram":
        assert server_refusal(pod["containers"][0]["args"]) is None


def test_the_crd_rule_is_the_generated_one(crd: dict[str, Any]) -> None:
    node = _node({"properties": {"spec": _crd_spec_schema(crd)}}, "spec.engine.extraArgs")
    assert [r["rule"] for r in node["x-kubernetes-validations"]] == [admission.extra_args_rule()]
    assert node["items"]["pattern"] == admission.ARG_PATTERN


def _prefixes() -> list[str]:
    out = {"", "-", "--"}
    for flag in admission.MANAGED_FLAGS:  # short, medium and whole-but-one prefixes, and it
        out.update(flag[:i] for i in (3, 5, len(flag) - 1, len(flag)))
    return sorted(out)


SMUGGLED = [
    *_prefixes(),
    "--api-k=x",
    "--api-key=x",
    "--mod=/etc",
    "--port=1",
    "--drain=0",
    "--seed=1",  # not managed, but "=": one item per flag and value
]


@pytest.mark.parametrize("arg", SMUGGLED)
def test_extra_args_cannot_name_a_managed_flag(crd_schema: StructuralSchema, arg: str) -> None:
    spec = {**BASE, "engine": {"extraArgs": [arg, "x"]}}
    assert any("extraArgs" in e for e in crd_accepts(crd_schema, spec)), arg
    assert "extraArgs" in (operator_accepts(crd_schema, spec) or ""), arg


def test_extra_args_the_server_takes_still_pass(crd_schema: StructuralSchema) -> None:
    extra = ["--enforce-eager", "--seed", "3", "--num-kv-blocks", "64", "--no-warmup"]
    spec = {**BASE, "engine": {"extraArgs": extra, "device": "cpu"}}
    assert crd_accepts(crd_schema, spec) == [] and operator_accepts(crd_schema, spec) is None
    args = server_args(parse_spec(crd_schema.default({"spec": spec})["spec"]))
    assert server_refusal(args) is None
    bad = {**BASE, "engine": {"extraArgs": ["--seed", "1\n--api-key"]}}
    assert crd_accepts(crd_schema, bad) and operator_accepts(crd_schema, bad)


# ---- environment --------------------------------------------------------------------------------
def test_env_cannot_override_what_the_operator_sets(crd_schema: StructuralSchema) -> None:
    llmd = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}}
    parsed = parse_spec({**BASE, "service": {"apiKeySecretRef": {"name": "k"}}})
    pod = render_deployment(llmd, parsed, OperatorConfig(), 1)["spec"]["template"]["spec"]
    set_by_operator = {e["name"] for c in pod["containers"] for e in c["env"]}
    assert set_by_operator <= set(admission.MANAGED_ENV)
    for name in admission.MANAGED_ENV:
        spec = {**BASE, "env": [{"name": name, "value": ""}]}
        assert any("spec.env" in e for e in crd_accepts(crd_schema, spec)), name
        assert name in (operator_accepts(crd_schema, spec) or ""), name
    fine = {**BASE, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}
    assert crd_accepts(crd_schema, fine) == [] and operator_accepts(crd_schema, fine) is None


# ---- patterns: the same meaning in RE2 (the API server) and Python (the operator) ----------
PATTERNS = {
    "spec.model.source": admission.SOURCE_PATTERN,
    "spec.model.revision": admission.REVISION_PATTERN,
    "spec.autoscaling.prometheusUrl": admission.URL_PATTERN,
    "spec.resources.memory": admission.QUANTITY_PATTERN,
}
HOSTILE_SOURCES = [
    "pvc://claim/../../../etc",
    "pvc://claim/models/../secret",
    "pvc://claim/.hidden",
    "hf://org/model\n",
    "hf://org/model\nx",
    "hf://org/modèle",
    "hf://org/mo del",
    "hf://org/..",
    "hf://org/a..b",
    "hf://оrg/model",  # Cyrillic o
    "pvc://claim/a;rm -rf /",
    "pvc://claim/$(id)",
    "s3://bucket/a`id`",
    "s3://bucket/key|x",
    "s3://bucket/../x",
    "s3://Bucket/x",
    "builtin://demo\n",
    "",
]
GOOD_SOURCES = [
    "hf://Qwen/Qwen2.5-1.5B-Instruct",
    "hf://gpt2",
    "hf://meta-llama/Llama-3.1-8B",
    "pvc://models",
    "pvc://models/llama/v1.2/",
    "s3://my-bucket/models/llama-3/date=2024-01",
    "builtin://demo",
]
URLS_OK = [
    "http://prometheus.monitoring.svc:9090",
    "https://p.example.com/prom/",
    "http://[::1]:9090",
]
URLS_BAD = ["http://p:9090\n", "http://p:9090/\nx", "http://p 9090", "ftp://p", "http://pé"]
OTHERS = ["main", "v1.0", "a\n", "16Gi", "1\n"]
CORPUS = [*HOSTILE_SOURCES, *GOOD_SOURCES, *URLS_OK, *URLS_BAD, *OTHERS]


@pytest.mark.parametrize("path", sorted(PATTERNS))
def test_patterns_are_the_crds_and_mean_the_same_in_re2_and_python(
    crd: dict[str, Any], path: str
) -> None:
    pattern = PATTERNS[path]
    node = _node({"properties": {"spec": _crd_spec_schema(crd)}}, path)
    assert node["pattern"] == pattern
    assert not re.search(r"\\[wWsSdDbB]", pattern), "Unicode-dependent class"
    for text in CORPUS:
        in_re2 = re2.search(pattern, text) is not None
        assert in_re2 == admission.matches(pattern, text), (pattern, text)


@pytest.mark.parametrize("source", HOSTILE_SOURCES)
def test_hostile_sources_are_refused(crd_schema: StructuralSchema, source: str) -> None:
    spec = {"model": {"source": source}}
    assert crd_accepts(crd_schema, spec), source
    assert operator_accepts(crd_schema, spec), source


@pytest.mark.parametrize("source", GOOD_SOURCES)
def test_real_sources_pass(crd_schema: StructuralSchema, source: str) -> None:
    spec = {"model": {"source": source}}
    assert crd_accepts(crd_schema, spec) == [] and operator_accepts(crd_schema, spec) is None


def test_prometheus_urls(crd_schema: StructuralSchema) -> None:
    for url, ok in [*((u, True) for u in URLS_OK), *((u, False) for u in URLS_BAD)]:
        spec = {**BASE, "autoscaling": {"prometheusUrl": url}}
        assert (crd_accepts(crd_schema, spec) == []) == ok, url
        assert (operator_accepts(crd_schema, spec) is None) == ok, url
