"""End to end with real parts: Prometheus scraping real ``kvscale serve`` processes, the
operator's autoscaler (``kopf run``) against the API emulator, and the benchmark client's
requests as load (see :mod:`tests.autoscaling.scenario`). About a minute and a half."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.autoscaling.scenario import ScenarioParams, run_scenario
from tests.autoscaling.timeline import summarize

pytestmark = pytest.mark.slow
PARAMS = ScenarioParams()
REASON = re.compile(
    r"^New size: (\d+); avg (KV usage|queue depth) \d+\.\d\d [<>] target [\d.]+ "
    r"on \d+ replicas? -> (\d+)( \(.*\))?$"
)


@pytest.fixture(scope="module")
def timeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario(tmp_path_factory.mktemp("autoscale-e2e"), PARAMS)


@pytest.fixture(scope="module")
def summary(timeline: dict[str, Any]) -> dict[str, Any]:
    out = summarize(timeline)
    print(out)
    return out


def test_the_load_fills_the_kv_pools_and_queues(
    timeline: dict[str, Any], summary: dict[str, Any]
) -> None:
    assert summary["requests_ok"] > 50
    assert summary["requests_failed"] == 0, timeline["request_errors"]
    assert summary["max_pod_kv"] >= 0.75  # the small pools really fill up
    assert summary["max_pod_waiting"] >= 4  # and requests queue


def test_scales_up_within_two_periods(summary: dict[str, Any]) -> None:
    # The replica timeline is sampled every half second, so that much is measurement error.
    limit = 2 * PARAMS.interval_s + PARAMS.sample_period_s
    assert summary["scale_up_after_s"] is not None
    assert summary["scale_up_after_s"] <= limit, summary["scalings"]
    assert summary["max_replicas"] == PARAMS.max_replicas


def test_no_scale_down_while_the_load_lasts(summary: dict[str, Any]) -> None:
    assert summary["decreases_during_load"] == 0, summary["scalings"]


def test_scales_down_after_the_stabilization_window(
    timeline: dict[str, Any], summary: dict[str, Any]
) -> None:
    after = summary["scale_down_after_load_end_s"]
    assert after is not None and summary["final_replicas"] == 1
    # The last high recommendation comes at most one period before the load ends (metrics
    # lag a scrape); requests still in flight then drain, and the window must pass after it.
    drain = timeline["drained"] - timeline["load_end"]
    assert PARAMS.window_s - PARAMS.interval_s <= after, summary["scalings"]
    assert after <= PARAMS.window_s + drain + 4 * PARAMS.interval_s, summary["scalings"]


def test_no_flapping(summary: dict[str, Any]) -> None:
    assert summary["direction_changes"] == 1, summary["scalings"]  # up, then down: once
    assert len(summary["scalings"]) <= 4


def test_every_scaling_has_an_event_with_a_readable_reason(timeline: dict[str, Any]) -> None:
    rescales = [e for e in timeline["events"] if e["reason"] == "SuccessfulRescale"]
    assert len(rescales) == len(summarize(timeline)["scalings"])
    for event in rescales:
        match = REASON.match(event["message"])
        assert match and match[1] == match[3], event["message"]
    assert not [e for e in timeline["events"] if e["type"] == "Warning"]


def test_operator_ran_cleanly(timeline: dict[str, Any]) -> None:
    assert timeline["operator_log_errors"] == []
    assert timeline["kubelet_errors"] == []
