"""n > 1: a request's sequences, and the siblings that wait for the first one's prompt to be cached."""
from __future__ import annotations

import dataclasses

import torch

from backend.engine_types import GenerationRequest
from backend.sampler import make_generator
from backend.scheduler import Scheduler, StepResult
from backend.sequence import Sequence


def request_sequences(req: GenerationRequest, device: torch.device) -> list[Sequence]:
    """One sequence per sample, each with its own RNG and grammar state."""
    seqs = []
    for index in range(req.n):
        sampling = req.sampling
        if sampling.seed is not None and index:
            # n > 1 with a seed: distinct but reproducible streams.
            sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
        features: list[object] = [] if req.grammar is None else [req.grammar.copy()]
        if req.adapter is not None:
            features.append(req.adapter)
        seq = Sequence(req.request_id, req.prompt_ids, req.stop, arrival_time=req.arrival_time, index=index,
                       sampling=sampling, generator=make_generator(sampling, device), features=features,
                       extra_key=b"" if req.adapter is None else req.adapter.cache_key)
        seq.hold_blocks = req.hold_blocks
        seqs.append(seq)
    return seqs


class Siblings:
    """Siblings wait here until the first sequence has computed (and cached) the prompt, then join the
    scheduler with a prefix-cache hit instead of computing the same prompt n times. Engine thread only."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[Sequence]] = {}  # request id → its sequences after the first

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, scheduler: Scheduler, seqs: list[Sequence]) -> None:
        scheduler.add(seqs[0])
        if len(seqs) > 1:
            self._waiting[seqs[0].request_id] = seqs[1:]

    def admit(self, scheduler: Scheduler, results: list[StepResult]) -> None:
        """Siblings of every sequence that sampled its first token this step join the scheduler."""
        for r in results:
            for sibling in self._waiting.pop(r.seq.request_id, ()):
                scheduler.add(sibling)

    def drop(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
