"""``kvscale serve --speculative-method ngram``: streamed completions on a model that
repeats itself, with the drafts accepted and counted in ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, metric


@pytest.fixture(scope="module")
def server(echo_ckpt: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        echo_ckpt, "--speculative-method", "ngram", "--ngram-min", "1",
        "--num-speculative-tokens", "4", "--max-model-len", "128",
    )  # fmt: skip


def test_streamed_tokens_and_spec_metrics(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": [5, 9, 9, 9], "max_tokens": 21, "stream": True,
            "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(line)
    assert '"completion_tokens":21' in chunks[-1].replace(" ", "")
    m = server.metrics()
    # the prefill emits 1 token, then 4 steps of 4 accepted drafts + 1
    assert metric(m, "kvscale:spec_decode_num_drafts_total") == 4
    assert metric(m, "kvscale:spec_decode_num_draft_tokens_total") == 16
    assert metric(m, "kvscale:spec_decode_num_accepted_tokens_total") == 16
    for pos in range(4):
        assert (
            metric(m, "kvscale:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos))
            == 4
        )
    assert metric(m, "kvscale:generation_tokens_total") == 21
    assert "kvscale:spec_decode_draft_available{model_name=tiny}" not in m  # no sidecar
