"""Iteration-level continuous batching with chunked prefill and recompute preemption.

Each step builds one batch: first the running sequences (decodes, and prefills still
in progress) in arrival order, then waiting ones, all within ``max_num_batched_tokens``
new tokens and ``max_num_seqs`` sequences. A prompt longer than the remaining budget
is prefilled in chunks over several steps. When a running sequence needs a block and
none is free, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed from its tokens later (its
generated tokens are kept, so nothing is lost). A running sequence marked ``stopping``
(its last token is being sampled by the step in flight) is skipped.

With prefix caching, a sequence admitted from the queue (new, or preempted earlier)
first looks its full blocks up in the cache (``BlockManager.match``): the blocks found
join its table and its prefill starts after them, always leaving its last token to be
computed so that it has logits to sample. Every step then registers the sequence's full
blocks whose tokens are final and whose K/V this step computes, so a sequence admitted
later, in this step or any after, can share them (within a step, attention reads a
layer's cache after the whole step's K/V was written to it).

Speculative decoding: a running sequence with ``draft_tokens`` feeds its last token and
the drafts in one step (``1 + d`` new tokens); drafts are trimmed to the step's token
budget and dropped rather than preempt another sequence for their blocks. Only accepted
tokens are ever registered in the prefix cache (drafts are not in ``token_ids``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvscale.server.engine.block_hash import block_hashes
from kvscale.server.engine.block_manager import BlockManager
from kvscale.server.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences of one step and how many new tokens each feeds the model."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the cache
        self.prefix_cache_hits = 0  # of those, tokens found

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0 or seq.stopping:
                i += 1
                continue
            if seq.draft_tokens:
                n += self._fit_drafts(seq, budget - n)
            if self._reserve(seq, n, batch):
                self._commit(seq, min(seq.num_computed_tokens + n, seq.num_tokens))
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
            else:
                break  # seq itself was preempted; everything after it already was
        if batch.preempted:
            return batch  # don't admit new work while evicting
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self._lookup(seq)
            start = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.blocks.can_allocate(seq.block_table, start + n, hits):
                break
            self.blocks.allocate(seq.block_table, start + n, hits)
            if self.blocks.enable_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += start
                seq.num_cached_tokens = start
            seq.num_computed_tokens = start
            seq.num_committed_blocks = len(hits)
            self._commit(seq, start + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The hashes of the full blocks of ``seq``'s first ``num_tokens`` tokens that are
        final (extended as tokens become known; kept across preemption)."""
        if len(seq.block_hashes) < num_tokens // self.blocks.block_size:
            seq.block_hashes = block_hashes(
                seq.token_ids, self.blocks.block_size, seq.cache_salt, seq.block_hashes, num_tokens
            )
        return seq.block_hashes

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks a sequence without computed tokens can start from."""
        if not self.blocks.enable_caching or seq.num_computed_tokens or seq.block_table:
            return []
        if seq.prompt_lps is not None and seq.prompt_lp_next < seq.num_prompt_tokens - 1:
            return []  # prompt logprobs need every prompt position computed
        limit = (seq.num_tokens - 1) // self.blocks.block_size  # the last token is computed
        return self.blocks.match(self._hashes(seq, seq.num_tokens)[:limit])

    def _commit(self, seq: Sequence, num_tokens: int) -> None:
        """Registers the full, final blocks among ``seq``'s first ``num_tokens`` tokens."""
        full = num_tokens // self.blocks.block_size
        # most steps complete no block: nothing to hash or slice (a decode step at batch
        # 256 would otherwise copy every sequence's hash list)
        if not self.blocks.enable_caching or full <= seq.num_committed_blocks:
            return
        hashes = self._hashes(seq, num_tokens)[:full]
        if len(hashes) > seq.num_committed_blocks:
            self.blocks.commit(seq.block_table, hashes, seq.num_committed_blocks)
            seq.num_committed_blocks = len(hashes)

    def _fit_drafts(self, seq: Sequence, budget: int) -> int:
        """Trims ``seq``'s drafts to ``budget`` tokens and to the free blocks (drafts never
        preempt); returns how many it keeps."""
        keep = min(len(seq.draft_tokens), max(budget, 0))
        need = seq.num_tokens + keep
        while keep and not self.blocks.can_allocate(seq.block_table, need):
            keep -= 1
            need -= 1
        del seq.draft_tokens[keep:]
        return keep

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Allocates blocks for ``n`` more tokens of ``seq``, preempting the newest if needed."""
        if not self.blocks.num_new_blocks(seq.block_table, seq.num_computed_tokens + n):
            return True  # its blocks hold them already (most decode steps): nothing to take
        while not self.blocks.can_allocate(seq.block_table, seq.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq.block_table, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.draft_tokens = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
