"""The Dockerfiles, statically: entrypoints match the CLIs, pins, non-root, labels match the chart
(tests/images builds and runs the images)."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import helm_python as helm
import kopf.cli
import pytest
import yaml

from kvscale.cli import build_parser
from tests.operator.conftest import ROOT

DOCKER = ROOT / "docker"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    start = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[start:]


def exec_form(steps: list[tuple[str, str]], word: str) -> list[str]:
    (value,) = [rest for w, rest in steps if w == word]
    parsed = json.loads(value)  # exec form: no shell between the runtime and the process
    assert isinstance(parsed, list)
    return parsed


@pytest.mark.parametrize("name", ["server.Dockerfile", "operator.Dockerfile"])
def test_images_are_pinned_and_run_as_non_root(name: str) -> None:
    steps = instructions(DOCKER / name)
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    for word, rest in steps:
        if word == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
            assert re.match(r"^[\w./-]+:\d+\.\d+\.\d+[\w.-]*$", image), f"{image} is not pinned"
        if word == "RUN" and "pip install" in rest:
            for req in re.findall(r"pip install ([^&|]+)", rest):
                for token in req.split():
                    if token.startswith("${") and ":+" in token:
                        continue  # an optional flag from a build argument, e.g. an index URL
                    if not token.startswith(("-", '"', "/", "fastapi", "uvicorn", "prometheus")):
                        assert "==" in token or token.startswith("-"), f"unpinned {token} in {name}"
    last = final_stage(DOCKER / name)
    assert ("USER", "1000:1000") in last
    assert (DOCKER / f"{name}.dockerignore").exists()


def test_server_entrypoint_is_the_kvscale_cli() -> None:
    steps = final_stage(DOCKER / "server.Dockerfile")
    assert exec_form(steps, "ENTRYPOINT") == ["kvscale"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvscale"] == "kvscale.cli:main"
    cmd = exec_form(steps, "CMD")
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000
    assert ("EXPOSE", "8000") in steps


def test_operator_entrypoint_is_kopf_running_the_handlers() -> None:
    steps = final_stage(DOCKER / "operator.Dockerfile")
    assert exec_form(steps, "ENTRYPOINT") == ["kopf"]
    cmd = exec_form(steps, "CMD")
    run = kopf.cli.main.commands[cmd[0]]
    params = run.make_context(cmd[0], cmd[1:]).params
    assert params["modules"] == ("kvscale.operator.handlers",) and params["standalone"]
    assert importlib.util.find_spec("kvscale.operator.handlers") is not None
    # the chart overrides CMD with its own args: they must parse the same way
    with helm.Chart.load(ROOT / "charts" / "kvscale") as chart:
        deploy = yaml.safe_load(
            chart.render(name="k", namespace="n")["kvscale/templates/deployment.yaml"]
        )
    chart_args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert run.make_context(chart_args[0], chart_args[1:]).params["modules"] == (
        "kvscale.operator.handlers",
    )
    env = " ".join(rest for word, rest in steps if word == "ENV")
    assert (
        "PYTHONSAFEPATH=1" in env
    )  # operator/ in a working directory must never shadow the stdlib


def test_operator_image_pins_match_the_tested_ones() -> None:
    image = dict(
        line.split("==")
        for line in (DOCKER / "operator-requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    tested = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            tested[name.lower().replace("_", "-")] = version.strip()
    for name, version in image.items():
        key = name.lower().replace("_", "-")
        if key in tested:
            assert tested[key] == version, f"{name}: image {version}, tests {tested[key]}"
    assert "kopf" in image and "torch" not in image


def test_server_torch_is_pinned_and_selectable_by_build_argument() -> None:
    steps = instructions(DOCKER / "server.Dockerfile")
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])  # the GPU build by default
    assert "TORCH_INDEX_URL" in args
    assert any(w == "RUN" and "torch==${TORCH_VERSION}" in rest for w, rest in steps)


def _labels(name: str) -> dict[str, str]:
    labels = {}
    for word, rest in final_stage(DOCKER / name):
        if word == "LABEL":
            for key, value in re.findall(r'([\w.-]+)="([^"]*)"', rest):
                labels[key] = value
    return labels


def test_image_labels_match_the_chart_and_the_package() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "kvscale" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "kvscale" / "values.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    refs = {
        "server.Dockerfile": values["serverImage"]["repository"],
        "operator.Dockerfile": values["image"]["repository"],
    }
    for name, repository in refs.items():
        labels = _labels(name)
        assert labels["org.opencontainers.image.title"] == repository.rsplit("/", 1)[1]
        # the chart's image tags default to its appVersion: the images carry that version
        assert labels["org.opencontainers.image.version"] == str(chart["appVersion"])
        assert labels["org.opencontainers.image.version"] == project["version"]
        assert labels["org.opencontainers.image.licenses"] == project["license"]["text"]
        assert labels["org.opencontainers.image.source"].startswith("https://")
    assert values["image"]["tag"] == "" and values["serverImage"]["tag"] == ""
