"""Fuzzes the server's own OpenAPI schema (``/openapi.json``) with schemathesis: valid and
invalid requests alike must never get a 5xx (nor an error event inside a 200 stream),
and the server must still answer normally afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from .conftest import ServerProcess

MAX_EXAMPLES = 50  # per operation and generation mode (valid / invalid requests)


@pytest.fixture(scope="module")
def fuzz_server(llama_ckpt: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    # A short context keeps the generated requests cheap on a CPU.
    return start_server(llama_ckpt, "--max-model-len", "48", "--disable-access-log")


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def test_every_operation_is_fuzzed(api_schema: Any) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


# a path string has no invalid form
WITH_INPUT = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if p in WITH_INPUT
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_server_errors(
    api_schema: Any, fuzz_server: ServerProcess, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=fuzz_server.url, timeout=60)
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if "text/event-stream" in response.headers.get("content-type", ""):
            assert '"server_error"' not in response.text, response.text[:500]

    check()


def test_the_server_still_answers_after_fuzzing(fuzz_server: ServerProcess) -> None:
    assert fuzz_server.proc.poll() is None
    assert httpx.get(f"{fuzz_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{fuzz_server.url}/ready").status_code == 200
    r = httpx.post(
        f"{fuzz_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in fuzz_server.log()
