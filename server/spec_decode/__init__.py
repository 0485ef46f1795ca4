"""Speculative decoding: exact verification of drafted tokens (``rejection_sampler``) and
proposers that draft them (``ngram_proposer``; a draft model in process, ``draft_runner``,
or in a sidecar, ``draft_sidecar`` over ``draft_protocol``). None holds engine state."""
