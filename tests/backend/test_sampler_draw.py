"""The batched sampler draws from the right distribution, honours its filters, and keeps seeds per row."""
from __future__ import annotations

import torch

from backend.sampler import SampleRow, SamplingParams, make_generator, sample

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
