"""Structured outputs: grammar specs (``params``), their compilation and token masks
(``backend``, xgrammar) and the engine's per-sequence grammar state (``manager``)."""
