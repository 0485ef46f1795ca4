"""The operator at scale, small (#14): ``bench/operator_scale.py`` on 8 LLMDeployments.

Pod events that change nothing must cost the operator no API request (kopf indexes hold
the watched LLMDeployments, children and pods; before them every pod event read the
owner, its three children and listed its pods: 5 requests), and an apply must reach its
Deployment quickly. The 25-200-object numbers are in the README.
"""

from __future__ import annotations

from pathlib import Path

from tests.bench_scripts import load_bench

scale = load_bench("operator_scale")


def test_pod_events_cost_no_request_and_applies_are_fast(tmp_path: Path) -> None:
    r = scale.measure(8, churn_s=4.0, workdir=tmp_path)
    churn = r["churn"]
    assert churn["pod_events"] == 16
    assert churn["requests_per_pod_event"] == 0, churn["by_kind"]
    assert r["single_apply_to_deployment_s"]["median"] < 2.0, r
