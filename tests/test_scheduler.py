"""The scheduler on its own: budgets, chunking, preemption order (no model needed)."""

from __future__ import annotations

import random

from kvscale.server.engine.block_manager import BlockManager
from kvscale.server.engine.scheduler import Scheduler
from kvscale.server.engine.sequence import Sequence, SequenceStatus
from kvscale.server.sampling_params import SamplingParams


def _seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(1, prompt_len + 1)), SamplingParams())


def _run_step(sched: Scheduler, rng: random.Random, max_out: int) -> list[Sequence]:
    """Schedules one step, then plays the model: advance and append a token where due."""
    batch = sched.schedule()
    assert batch.total_tokens <= sched.max_num_batched_tokens
    assert len(batch) <= sched.max_num_seqs
    assert len({s.seq_id for s in batch.seqs}) == len(batch)
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * sched.blocks.block_size >= seq.num_computed_tokens + n
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(rng.randrange(100), 0.0)
            if seq.num_output_tokens >= max_out:
                sched.finish(seq)
                finished.append(seq)
    return finished


def test_budgets_chunking_and_completion() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=10)
    seqs = [_seq(i, rng.randint(1, 30)) for i in range(20)]
    for s in seqs:
        sched.add(s)
    done: list[Sequence] = []
    for _ in range(2000):
        done += _run_step(sched, rng, max_out=5)
        if not sched.has_work():
            break
    assert sorted(s.seq_id for s in done) == list(range(20))
    assert all(s.num_output_tokens == 5 for s in done)
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.num_preemptions > 0  # 16 blocks of 4 are too few for 6 sequences of up to 35


def test_long_prompt_is_prefilled_in_chunks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    s = _seq(0, 30)
    sched.add(s)
    chunks = []
    while s.num_output_tokens == 0:
        batch = sched.schedule()
        chunks.append(batch.num_new_tokens[0])
        s.num_computed_tokens += batch.num_new_tokens[0]
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7, 0.0)
    assert chunks == [8, 8, 8, 6]


def test_newest_running_sequence_is_preempted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    old, new = _seq(0, 8), _seq(1, 8)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()  # both prompts: 4 blocks, pool full
    assert batch.seqs == [old, new]
    for seq in (old, new):
        seq.num_computed_tokens = 8
        seq.append_token(1, 0.0)
    batch = sched.schedule()  # old needs a 3rd block: new is evicted
    assert batch.seqs == [old] and batch.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.token_ids[-1] == 1  # its generated token is kept for recompute
    assert list(sched.waiting) == [new]
