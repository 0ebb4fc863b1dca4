"""The sampler's bans and typical_p: allowed_token_ids, bad words, eos and stop tokens held back before
min_new_tokens (the engine's _suppressed), locally typical sampling. Greedy and drawn rows alike."""
from __future__ import annotations

import torch

from backend.engine import _suppressed
from backend.sampler import SampleRow, make_generator, sample
from backend.sequence import Sequence, StopConditions
from kvyard.sampling_params import SamplingParams

CPU = torch.device("cpu")
LOGITS = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])   # token 0 is the greedy pick


def picks(p: SamplingParams, output: list[int] = (), suppressed: tuple[int, ...] = (), draws: int = 200) -> set[int]:
    row = SampleRow(p, make_generator(p, CPU), [9], list(output), suppressed=suppressed)
    return {sample(LOGITS.clone(), [row])[0].token_id for _ in range(1 if p.greedy else draws)}


def test_allowed_token_ids_restrict_greedy_and_drawn_rows() -> None:
    assert picks(SamplingParams(allowed_token_ids=(3, 4))) == {3}
    assert picks(SamplingParams(temperature=5.0, seed=1, allowed_token_ids=(3, 4))) == {3, 4}


def test_bad_words_ban_their_last_token_after_the_rest() -> None:
    assert picks(SamplingParams(bad_words_ids=((0,),))) == {1}                # one token: always banned
    word = SamplingParams(bad_words_ids=((2, 0),))
    assert picks(word, output=[1]) == {0}                                     # not after its first token
    assert picks(word, output=[1, 2]) == {1}                                  # right after it
    assert 0 not in picks(SamplingParams(temperature=5.0, seed=2, bad_words_ids=((0,),)))


def test_suppressed_ids_are_never_picked_and_the_engine_suppresses_until_min_new_tokens() -> None:
    assert picks(SamplingParams(), suppressed=(0, 1)) == {2}
    assert not picks(SamplingParams(temperature=5.0, seed=3), suppressed=(0,)) & {0}
    stop = StopConditions(max_new_tokens=8, eos_token_ids=frozenset({0}), stop_token_ids=frozenset({1}),
                          min_new_tokens=2)
    seq = Sequence("r", [9], stop)
    assert set(_suppressed(seq)) == {0, 1}
    seq.append_token(4)
    seq.append_token(5)
    assert _suppressed(seq) == ()                                             # min_new_tokens reached
    ignoring = Sequence("r", [9], StopConditions(max_new_tokens=8, eos_token_ids=frozenset({0}),
                                                 min_new_tokens=2, ignore_eos=True))
    assert _suppressed(ignoring) == ()                                        # eos stops nothing then


def test_typical_p_keeps_the_tokens_nearest_the_entropy() -> None:
    # One likely token and many unlikely ones: the entropy is low, so the likely token is the typical one.
    logits = torch.tensor([[8.0] + [0.0] * 50])
    p = SamplingParams(temperature=1.0, typical_p=0.2, seed=4)
    row = SampleRow(p, make_generator(p, CPU), [9], [])
    assert {sample(logits.clone(), [row])[0].token_id for _ in range(100)} == {0}
    off = SamplingParams(temperature=1.0, seed=4)
    row = SampleRow(off, make_generator(off, CPU), [9], [])
    assert len({sample(logits.clone(), [row])[0].token_id for _ in range(300)}) > 1


def test_out_of_vocabulary_bans_are_refused() -> None:
    for p in (SamplingParams(allowed_token_ids=(99,)), SamplingParams(bad_words_ids=((1, 99),))):
        try:
            p.validate(10)
        except ValueError as exc:
            assert "out of the vocabulary" in str(exc)
        else:
            raise AssertionError(f"{p} was accepted")
