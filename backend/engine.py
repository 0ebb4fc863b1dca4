"""The backend's step loop: schedule → run the model → sample → hand tokens back to the scheduler."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from backend.model_runner import ModelRunner
from backend.sampler import Sample, SampleRow, SamplingParams, make_generator, sample
from backend.scheduler import Scheduler, ScheduledSeq
from backend.sequence import FinishReason, Sequence, StopConditions
from kvyard.errors import ErrorCode, RequestError


@dataclass
class GenerationRequest:
    """A validated request as the engine takes it (built from protobuf in server.py)."""
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopConditions
    n: int = 1                       # sequences sampled from this prompt
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class AuxInfo:
    input_len: int
    output_len: int
    iter_count: int
    reuse_len: int
    cost_time_us: int
    first_token_cost_time_us: int
    wait_time_us: int


@dataclass
class TokenOutput:
    """One sequence's new token in one step."""
    request_id: str
    index: int                            # which of the request's n sequences
    token_id: int
    sample: Sample                        # carries logprobs when asked
    finish_reason: FinishReason | None
    aux: AuxInfo


@dataclass
class _SeqState:
    """Per-sequence data the scheduler carries for us as Sequence.payload."""
    index: int
    sampling: SamplingParams
    generator: torch.Generator | None
    iter_count: int = 0


class Engine:
    """Single-threaded: only the engine loop thread calls add / abort / step."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, vocab_size: int,
                 max_model_len: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def validate(self, req: GenerationRequest) -> None:
        """Raises RequestError for input this engine can never serve. Pure: safe from any thread."""
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt has no tokens", "token_ids")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"token ids out of the vocabulary (size {self.vocab_size}): {bad[:5]}",
                               "token_ids")
        if n_prompt >= self.max_model_len:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"the prompt has {n_prompt} tokens; this model's context is "
                               f"{self.max_model_len} tokens, so at most {self.max_model_len - 1} "
                               "prompt tokens leave room for one generated token", "token_ids")
        if not self.scheduler.fits_ever(n_prompt + 1):
            raise RequestError(ErrorCode.OUT_OF_KV_CACHE,
                               f"a prompt of {n_prompt} tokens can never fit this backend's KV cache",
                               "token_ids")
        if req.n < 1:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"n must be >= 1, got {req.n}", "n")
        try:
            req.sampling.validate(self.vocab_size)
        except ValueError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc

    def add(self, req: GenerationRequest) -> None:
        device = self.runner.device
        for index in range(req.n):
            sampling = req.sampling
            if sampling.seed is not None and index:
                # n > 1 with a seed: distinct but reproducible streams.
                sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + index})
            state = _SeqState(index, sampling, make_generator(sampling, device))
            self.scheduler.add(Sequence(req.request_id, req.prompt_ids, req.stop, payload=state,
                                        arrival_time=req.arrival_time))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[TokenOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        for s in batch.scheduled:
            _state(s.seq).iter_count += 1
        sampling_rows = [s for s in batch.scheduled if s.samples]
        logits = self.runner.run(batch.scheduled)  # [S, V]
        samples = sample(logits, [_sample_row(s.seq) for s in sampling_rows])
        by_seq = {s.seq.seq_id: smp for s, smp in zip(sampling_rows, samples)}
        results = self.scheduler.update_from_output(
            batch, {seq_id: smp.token_id for seq_id, smp in by_seq.items()})
        now = time.monotonic()
        outputs = []
        for seq, token, finish in results:
            if token is None:
                continue
            outputs.append(TokenOutput(seq.request_id, _state(seq).index, token, by_seq[seq.seq_id],
                                       finish, _aux(seq, now)))
        return outputs


def _state(seq: Sequence) -> _SeqState:
    assert isinstance(seq.payload, _SeqState)
    return seq.payload


def _sample_row(seq: Sequence) -> SampleRow:
    st = _state(seq)
    return SampleRow(st.sampling, st.generator, seq.prompt_token_ids, seq.output_token_ids)


def _aux(seq: Sequence, now: float) -> AuxInfo:
    def us(t: float | None) -> int:
        return int(((t if t is not None else now) - seq.arrival_time) * 1e6)
    return AuxInfo(input_len=seq.num_prompt_tokens, output_len=seq.num_output_tokens,
                   iter_count=_state(seq).iter_count, reuse_len=seq.num_cached_tokens,
                   cost_time_us=us(now), first_token_cost_time_us=us(seq.first_token_time),
                   wait_time_us=us(seq.first_scheduled_time))
