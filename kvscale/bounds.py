"""Bounds of a number setting, one rule for the server's checks and the operator's (no
torch: the operator's image imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """Allowed values of a number: ``lo`` and ``hi`` inclusive (``lo_exclusive``: ``lo``
    itself not allowed); a None side is open."""

    lo: float | None = None
    hi: float | None = None
    lo_exclusive: bool = False

    def refusal(self, name: str, value: float | None) -> str | None:
        """Why ``name``'s ``value`` is refused, or None: an unset value (None) passes, NaN
        never does."""
        if value is None:
            return None
        if value != value:
            return f"{name} must be a number, got {value!r}"
        lo, hi = self.lo, self.hi
        low = lo is not None and (value <= lo if self.lo_exclusive else value < lo)
        if not low and (hi is None or value <= hi):
            return None
        if lo is None:
            return f"{name} must be <= {hi}, got {value!r}"
        if hi is None:
            return f"{name} must be {'>' if self.lo_exclusive else '>='} {lo}, got {value!r}"
        return f"{name} must be in {'(' if self.lo_exclusive else '['}{lo}, {hi}], got {value!r}"
