"""The inference server: engine, model layers, models, attention backends.

Offline use: ``from kvscale.server import LLM, SamplingParams``.
"""

from kvscale.server.llm import LLM
from kvscale.server.outputs import CompletionOutput, Logprob, RequestOutput
from kvscale.server.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
