"""The proposer a configuration asks for (``--speculative-method``), or None."""

from __future__ import annotations

from kvscale.server.config import ResolvedConfig
from kvscale.server.spec_decode.ngram_proposer import NgramProposer
from kvscale.server.spec_decode.proposer import Proposer


def make_proposer(config: ResolvedConfig) -> Proposer | None:
    """n-gram lookup (on the GPU when the target runs on one, else on the host), the draft
    model in this process, or the client of its sidecar (which starts unavailable and keeps
    retrying if the sidecar is not up yet). ValueError if the draft's tokenizer differs from
    the target's."""
    eng = config.engine
    k = eng.num_speculative_tokens
    if eng.speculative_method is None:
        return None
    if eng.speculative_method == "ngram":
        if config.torch_device.type == "cuda":
            from kvscale.server.spec_decode.ngram_device import DeviceNgramProposer

            return DeviceNgramProposer(k, eng.ngram_min, eng.ngram_max, config.torch_device)
        return NgramProposer(k, eng.ngram_min, eng.ngram_max)
    assert eng.speculative_model is not None  # EngineConfig checks it
    if eng.draft_placement == "sidecar":
        from kvscale.server.spec_decode.draft_sidecar import SidecarProposer
        from kvscale.server.spec_decode.tokenizer_check import tokenizer_fingerprint

        return SidecarProposer(
            eng.speculative_model,
            expected_fingerprint=tokenizer_fingerprint(eng.tokenizer or eng.model),
            vocab_size=config.model.vocab_size,
        )
    from kvscale.server.spec_decode.draft_runner import DraftRunner

    return DraftRunner.from_model_path(eng.speculative_model, config, k)
