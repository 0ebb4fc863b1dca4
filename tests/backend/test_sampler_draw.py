"""The batched sampler draws from the right distribution, honours its filters, and keeps seeds per row."""
from __future__ import annotations

import pytest
import torch

from backend.sampler import SampleRow, make_generator, sample
from kvyard.sampling_params import SamplingParams

CPU = torch.device("cpu")


def rows_for(params: list[SamplingParams]) -> list[SampleRow]:
    return [SampleRow(p, make_generator(p, CPU), [], []) for p in params]


def test_frequencies_follow_softmax_over_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    p = SamplingParams(temperature=0.7, seed=7)
    row = rows_for([p])
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(logits, row)[0].token_id] += 1
    want = torch.softmax(logits[0] / 0.7, -1)
    assert counts[4] == 0                                  # a ~e-40 token never comes up
    assert (counts / counts.sum() - want).abs().max() < 0.03


def test_filters_keep_only_allowed_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]] * 3)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2),
              SamplingParams(temperature=1.0, min_p=0.5, seed=3)]
    rows = rows_for(params)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        for j, s in enumerate(sample(logits, rows)):
            seen[j].add(s.token_id)
    assert seen[0] == {0, 1}
    assert seen[1] <= {0, 1} and 0 in seen[1]   # 0 alone holds ~36 %, 0 and 1 pass 0.5
    assert seen[2] == {0, 1, 2}


def test_seeded_row_is_independent_of_its_batch() -> None:
    logits = torch.randn(4, 1000)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    row = rows_for([seeded])
    alone = [sample(logits[:1], row)[0].token_id for _ in range(20)]
    mixed_row = rows_for([seeded])[0]
    others = rows_for([SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.5)])
    mixed = [sample(logits, [mixed_row, *others])[0].token_id for _ in range(20)]
    assert mixed == alone


def test_large_vocabulary_draws_follow_softmax() -> None:
    """The one-pass kernel path (rows without filters, a vocabulary past its 8-wide and 64-wide steps):
    the frequencies of the likely tokens and of the long tail follow softmax(logits / T)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1003, generator=gen) * 1.5
    logits[0, [5, 500, 1002]] += 6.0  # three likely tokens, one of them the last
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(64)]
    rows = rows_for(params)
    counts = torch.zeros(1003)
    for _ in range(250):
        for s in sample(logits.expand(64, -1).contiguous(), rows):
            counts[s.token_id] += 1
    freq = counts / counts.sum()
    want = torch.softmax(logits[0] / 0.9, -1)
    top = want.topk(10).indices
    assert (freq[top] - want[top]).abs().max() < 0.015
    tail = torch.ones(1003, dtype=torch.bool)
    tail[top] = False
    assert abs(freq[tail].sum() - want[tail].sum()) < 0.015


def test_greedy_rows_beside_drawn_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 777, generator=torch.Generator().manual_seed(1))
    rows = rows_for([SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()])
    got = [s.token_id for s in sample(logits, rows)]
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())


def test_non_finite_logits_fail_the_draw() -> None:
    """The engine isolates a row whose sampling raises (test_engine_isolation.py): a NaN or an infinite
    logit must raise, never turn into some token."""
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(2, 100)
        logits[1, 17] = bad
        with pytest.raises(ValueError):
            sample(logits, rows_for([SamplingParams(temperature=0.8, seed=1)] * 2))
