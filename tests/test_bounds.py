"""``kvscale.bounds.Bound``: the one rule for number settings (server and operator)."""

from __future__ import annotations

import pytest

from kvscale.bounds import Bound


@pytest.mark.parametrize(
    ("bound", "value", "message"),
    [
        (Bound(1), 1, None),
        (Bound(1), 0, "x must be >= 1, got 0"),
        (Bound(0.0, lo_exclusive=True), 0.0, "x must be > 0.0, got 0.0"),
        (Bound(0.0, lo_exclusive=True), 1e-9, None),
        (Bound(0.0, 1.0, lo_exclusive=True), 1.5, "x must be in (0.0, 1.0], got 1.5"),
        (Bound(1, 16), 16, None),
        (Bound(1, 16), 17, "x must be in [1, 16], got 17"),
        (Bound(hi=8), 9, "x must be <= 8, got 9"),
        (Bound(0), None, None),  # unset
        (Bound(), float("nan"), "x must be a number, got nan"),
        (Bound(0, lo_exclusive=True), float("inf"), None),
    ],
)
def test_refusals_name_the_setting_the_value_and_the_bound(
    bound: Bound, value: float | None, message: str | None
) -> None:
    assert bound.refusal("x", value) == message
