"""Piecewise compilation: the model's forward compiled once by Dynamo, split at the ops
that cannot be captured (attention), each piece compiled and captured as a CUDA graph per
token-count bucket (see ``backend.py`` for the flow and ``docs/architecture.md``)."""
