"""bench/graph_launch.py's CPU-runnable part: the transitions table (NOTES e80)."""

from __future__ import annotations

import pytest
import torch

from tests.bench_scripts import load_bench

gl = load_bench("graph_launch")


def test_transition_table_takes_medians_and_the_extra_time_a_node_against_alone() -> None:
    runs = {
        "alone": [1000.0, 1040.0, 1020.0],
        "after-others": [1150.0, 1170.0, 1160.0],
        "before-others": [1010.0, 1030.0, 1020.0],
    }
    rows = {r["condition"]: r for r in gl.transition_table(runs, nodes=400)}
    assert rows["alone"]["replay_us"] == 1020.0 and rows["alone"]["extra_us_per_node"] == 0.0
    assert rows["after-others"]["replay_us"] == 1160.0
    assert rows["after-others"]["extra_us"] == 140.0
    assert rows["after-others"]["extra_us_per_node"] == pytest.approx(140.0 / 400)
    assert rows["before-others"]["extra_us_per_node"] == 0.0
    assert list(rows) == list(runs)  # in the order measured


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's failure path")
def test_a_condition_that_fails_stops_the_run_with_its_error() -> None:
    """Each condition runs in a process of its own; without a GPU the first one fails,
    and the run stops naming it, with that process's traceback."""
    with pytest.raises(SystemExit, match=r"condition alone failed \(1\):\n(.|\n)*Traceback"):
        gl.transitions(nodes=6, others=2, replays=2, repeats=1)


def test_every_boundary_condition_is_run_and_enqueues_known_parts_ending_in_the_kernel() -> None:
    assert set(gl.BOUNDARIES) <= set(gl.CONDITIONS)
    for condition, parts in gl.BOUNDARIES.items():
        assert set(parts) <= set(gl.BOUNDARY_PARTS), condition
        assert parts[-1] == "kernel", condition  # the graph follows a kernel, as in a step
