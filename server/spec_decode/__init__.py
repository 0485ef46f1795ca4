"""Speculative decoding: exact verification of drafted tokens (``rejection_sampler``) and
proposers that draft them (``ngram_proposer``). Neither holds engine state."""
