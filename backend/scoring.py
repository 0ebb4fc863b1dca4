"""Scoring (ScoreCall): the logprobs of given tokens after a prompt, read off one prefill's logits."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.engine_types import ScoreRequest, ScoreResult
from backend.sampler import Sample
from backend.scheduler import ScheduledSeq
from backend.sequence import Sequence, StopConditions
from kvyard.aux_info import AuxInfo


@dataclass
class ScoreState:
    """What a scoring sequence carries besides its tokens."""
    score_from: int                  # position of the first scored token (== the prompt's length)
    top_logprobs: int = 0            # alternatives returned per scored position
    scores: dict[int, Sample] = field(default_factory=dict)  # position → its token's logprob, filled per chunk


def score_sequence(req: ScoreRequest) -> Sequence:
    """The prompt and the scored tokens as one sequence that samples a single (discarded) token."""
    features: list[object] = [ScoreState(len(req.prompt_ids), req.top_logprobs)]
    if req.adapter is not None:
        features.append(req.adapter)
    seq = Sequence(req.request_id, req.prompt_ids + req.scored_ids,
                   StopConditions(max_new_tokens=1, ignore_eos=True), arrival_time=req.arrival_time,
                   features=features, extra_key=b"" if req.adapter is None else req.adapter.cache_key)
    seq.max_cached_tokens = len(req.prompt_ids) - 1  # logits are needed from there on
    return seq


def logit_rows(s: ScheduledSeq) -> list[int]:
    """Chunk-relative rows whose logits this step needs: scored positions, then the sampling row."""
    rows: list[int] = []
    st = s.seq.feature(ScoreState)
    if st is not None:
        # The logits at position p give the probability of token p + 1.
        first = max(s.start, st.score_from - 1)
        last = min(s.start + s.num_new_tokens, len(s.seq.token_ids) - 1)
        rows = [p - s.start for p in range(first, last)]
    if s.samples and (not rows or rows[-1] != s.num_new_tokens - 1):
        rows.append(s.num_new_tokens - 1)
    return rows


def record_scores(s: ScheduledSeq, chunk_rows: list[int], logits: torch.Tensor) -> None:
    """logits: [len(chunk_rows), V], this chunk's rows from logit_rows."""
    st = s.seq.feature(ScoreState)
    assert st is not None
    logprobs = torch.log_softmax(logits, dim=-1)
    for r, row in enumerate(chunk_rows):
        p = s.start + row
        if not st.score_from - 1 <= p < len(s.seq.token_ids) - 1:
            continue
        token = s.seq.token_ids[p + 1]
        top = None
        if st.top_logprobs:
            vals, idx = logprobs[r].topk(st.top_logprobs)
            top = list(zip(idx.tolist(), vals.tolist()))
        st.scores[p + 1] = Sample(token, float(logprobs[r, token]), top)


def score_result(seq: Sequence, aux: AuxInfo) -> ScoreResult:
    """The finished sequence's answer: one Sample per scored token, in order."""
    st = seq.feature(ScoreState)
    assert st is not None
    positions = range(st.score_from, len(seq.token_ids) - 1)  # the extra sampled token is not ours
    return ScoreResult(seq.request_id, [st.scores[p] for p in positions], aux)
