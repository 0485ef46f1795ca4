"""The host side of a step: flat inputs from a batch, one packed transfer, placeholders."""

from __future__ import annotations

import numpy as np
import torch

from kvscale.server.engine.scheduler import ScheduledBatch
from kvscale.server.engine.sequence import Sequence
from kvscale.server.engine.step_inputs import padded_rows, plan_step
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.host_to_device import to_device
from kvscale.server.worker.step import resolve_placeholders


def _seq(i: int, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    s = Sequence(i, f"r{i}", 0, tokens[:3], SamplingParams())
    s.token_ids = list(tokens)
    s.num_computed_tokens = computed
    s.block_table = table
    return s


def test_a_mixed_batch_flattens_into_one_stream() -> None:
    decode = _seq(0, [5, 6, 7, 8, -2], 4, [3, 5])  # one new token: a placeholder (row 1)
    chunk = _seq(1, list(range(10, 20)), 2, [7, 9, 4])  # tokens 2..6 of 10: no sample
    last = _seq(2, [1, 2, 3, 4, 5], 3, [8, 2])  # its prompt completes: samples
    plan = plan_step(ScheduledBatch([decode, chunk, last], [1, 5, 2]), block_size=4)
    a = plan.arrays
    assert a["ids"].tolist() == [-2, 12, 13, 14, 15, 16, 4, 5]
    assert a["positions"].tolist() == [4, 2, 3, 4, 5, 6, 3, 4]
    # slot = table[pos // 4] * 4 + pos % 4
    assert a["slots"].tolist() == [
        5 * 4 + 0,
        7 * 4 + 2,
        7 * 4 + 3,
        9 * 4,
        9 * 4 + 1,
        9 * 4 + 2,
        8 * 4 + 3,
        2 * 4,
    ]
    assert a["q_start"].tolist() == [0, 1, 6, 8]
    assert a["seq_lens"].tolist() == [5, 7, 5]
    assert a["tables"].tolist() == [[3, 5, 0], [7, 9, 4], [8, 2, 0]]
    assert plan.sample_rows == [0, 2] and a["logits_idx"].tolist() == [0, 7]
    assert plan.max_query_len == 5 and plan.max_seq_len == 7 and not plan.decode_only


def test_graph_padding_rows_write_nothing() -> None:
    seqs = [_seq(i, [1, 2, 3, 4], 3, [i]) for i in range(3)]
    plan = plan_step(ScheduledBatch(seqs, [1, 1, 1]), block_size=4, pad_to=8)
    a = plan.arrays
    assert plan.decode_only and len(a["ids"]) == 8
    assert a["slots"].tolist()[3:] == [-1] * 5
    assert a["seq_lens"].tolist() == [4, 4, 4, 1, 1, 1, 1, 1]
    assert a["q_start"].tolist() == list(range(9))
    assert a["tables"].shape == (8, 1) and a["tables"][3:].sum() == 0
    assert a["logits_idx"].tolist() == [0, 1, 2]  # padding rows never sample


def test_one_packed_transfer_round_trips_mixed_dtypes() -> None:
    arrays = {
        "a": np.arange(5, dtype=np.int64) - 2,
        "b": np.arange(6, dtype=np.int32).reshape(2, 3),
        "c": np.array([[0.5, -1.25]], dtype=np.float32),
        "d": np.array([True, False, True]),
        "empty": np.zeros(0, dtype=np.int64),
        "t": np.arange(12, dtype=np.int64).reshape(3, 4).T,  # not C-contiguous
        "e": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    }
    out = to_device(arrays, torch.device("cpu"))
    assert all(t.is_contiguous() for t in out.values())
    out["a"][1:3] = 100  # a section written in place (as the worker places drafts)
    assert out["a"].tolist() == [-2, 100, 100, 1, 2] and out["b"].tolist() == arrays["b"].tolist()
    arrays["a"][1:3] = 100
    for name, a in arrays.items():
        t = out[name]
        assert (
            t.dtype
            == {
                "a": torch.int64,
                "b": torch.int32,
                "c": torch.float32,
                "d": torch.bool,
                "empty": torch.int64,
                "t": torch.int64,
                "e": torch.float32,
            }[name]
        )
        assert t.shape == a.shape and t.tolist() == a.tolist()


def test_placeholders_resolve_from_the_last_step() -> None:
    last = torch.tensor([40, 41, 42, 43])
    ids = torch.tensor([7, -1, 9, -4, -3, 0])
    assert resolve_placeholders(ids, last).tolist() == [7, 40, 9, 43, 42, 0]
    rows = padded_rows([[1, -2], [], [3]], pad=99)
    assert rows.tolist() == [[1, -2], [99, 99], [3, 99]]
    assert resolve_placeholders(torch.from_numpy(rows), last).tolist() == [
        [1, 41],
        [99, 99],
        [3, 99],
    ]


def test_the_plan_bounds_the_batchs_top_k() -> None:
    from kvscale.server.engine.step_inputs import sampling_inputs

    def plan(top_ks: list[int]):
        seqs = [
            Sequence(i, f"r{i}", 0, [1, 2], SamplingParams(temperature=0.7, top_k=k))
            for i, k in enumerate(top_ks)
        ]
        return sampling_inputs(seqs, {}, 100, {})

    p = plan([0, 20, 5])
    assert p.do_top_k and p.top_k_max == 20  # rows without top-k do not count
    p = plan([0, 0])
    assert not p.do_top_k and p.top_k_max == 0
