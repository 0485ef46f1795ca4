"""The OpenAI-compatible HTTP API (FastAPI app, launcher, lifecycle, tool parsers)."""
