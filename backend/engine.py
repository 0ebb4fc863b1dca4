"""The backend's step loop: schedule → run the model → sample → hand tokens back to the scheduler."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from backend.constraints import GrammarState, mask_words
from backend.engine_types import (AuxInfo, CacheStatus, GenerationRequest, ImportPlan, ScoreRequest,
                                  ScoreResult, TokenOutput, WorkerStatus)
from backend.model_runner import ModelRunner
from backend.sampler import Sample, SampleRow, SamplingParams, make_generator, sample
from backend.scheduler import Scheduler, ScheduledSeq
from backend.sequence import Sequence, StopConditions
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_N, MAX_TOP_LOGPROBS

log = logging.getLogger("kvyard.engine")

_EMA = 0.2  # weight of the newest step in the moving averages the master routes on


@dataclass
class _SeqState:
    """Per-sequence data the scheduler carries for us as Sequence.payload."""
    index: int
    sampling: SamplingParams
    generator: torch.Generator | None
    grammar: GrammarState | None = None  # the constraint's state: masks each sampled token, advanced by it
    iter_count: int = 0
    score_from: int | None = None    # scoring: position of the first scored token
    top_logprobs: int = 0            # scoring: alternatives per scored position
    scores: dict[int, Sample] = field(default_factory=dict)  # scoring: position → its token's logprob


class Engine:
    """Only the engine loop thread calls add / abort / step; status readers from other threads take
    `lock`, which step holds only while the scheduler's state changes (not during the forward pass)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, vocab_size: int,
                 max_model_len: int, role: str = "PDFUSION") -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.role = role
        self.lock = threading.Lock()  # the scheduler against load reports read on other threads (HTTP, metrics)
        self.iterations = 0
        # n > 1: siblings wait here until the first sequence has computed (and cached) the prompt,
        # then join with a prefix-cache hit instead of computing the same prompt n times.
        self._siblings: dict[str, list[Sequence]] = {}
        self.step_latency_ms = 0.0
        self.prefill_tokens_per_s = 0.0
        # Requests a step failed on their own (the batch went on); the engine loop reports and drains it.
        self.failed: list[tuple[str, RequestError]] = []

    # ---- requests in ------------------------------------------------------------------------

    def validate(self, req: GenerationRequest | ScoreRequest) -> None:
        """Raises RequestError for input this engine can never serve. Pure: safe from any thread."""
        ids = req.prompt_ids + (req.scored_ids if isinstance(req, ScoreRequest) else [])
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt has no tokens", "token_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"token ids out of the vocabulary (size {self.vocab_size}): {bad[:5]}",
                               "token_ids")
        if len(ids) >= self.max_model_len:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"the request has {len(ids)} tokens; this model's context is "
                               f"{self.max_model_len} tokens, so at most {self.max_model_len - 1} "
                               "input tokens leave room for one more", "token_ids")
        if not self.scheduler.fits_ever(len(ids) + 1):
            raise RequestError(ErrorCode.OUT_OF_KV_CACHE,
                               f"{len(ids)} tokens can never fit this backend's KV cache "
                               f"({self.scheduler.token_capacity} tokens)", "token_ids")
        if isinstance(req, ScoreRequest):
            if not req.scored_ids:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "nothing to score", "scored_ids")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
            return
        if not 1 <= req.n <= MAX_N:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.constraint is not None and req.grammar is None:
            raise RequestError(ErrorCode.INTERNAL, "the request's constraint was never compiled")
        try:
            req.sampling.validate(self.vocab_size)
        except ValueError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc

    def add(self, req: GenerationRequest | ScoreRequest) -> None:
        if isinstance(req, ScoreRequest):
            state = _SeqState(0, SamplingParams(), None, score_from=len(req.prompt_ids),
                              top_logprobs=req.top_logprobs)
            seq = Sequence(req.request_id, req.prompt_ids + req.scored_ids,
                           StopConditions(max_new_tokens=1, ignore_eos=True), payload=state,
                           arrival_time=req.arrival_time)
            seq.max_cached_tokens = len(req.prompt_ids) - 1  # logits are needed from there on
            with self.lock:
                self.scheduler.add(seq)
            return
        seqs = self._sequences(req)
        with self.lock:
            self.scheduler.add(seqs[0])
            if len(seqs) > 1:
                self._siblings[req.request_id] = seqs[1:]

    def _sequences(self, req: GenerationRequest) -> list[Sequence]:
        seqs = []
        for index in range(req.n):
            sampling = req.sampling
            if sampling.seed is not None and index:
                # n > 1 with a seed: distinct but reproducible streams.
                sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + index})
            state = _SeqState(index, sampling, make_generator(sampling, self.runner.device),
                              None if req.grammar is None else req.grammar.copy())
            seq = Sequence(req.request_id, req.prompt_ids, req.stop, payload=state, arrival_time=req.arrival_time)
            seq.hold_blocks = req.hold_blocks
            seqs.append(seq)
        return seqs

    # ---- prefill/decode hand-over (engine thread: EngineLoop commands) ------------------------

    def held_sequence(self, request_id: str) -> Sequence | None:
        with self.lock:
            return next((s for s in self.scheduler.held.values() if s.request_id == request_id), None)

    def release(self, request_id: str) -> None:
        with self.lock:
            for seq in [s for s in self.scheduler.held.values() if s.request_id == request_id]:
                self.scheduler.release(seq)

    def plan_import(self, req: GenerationRequest, prompt_len: int) -> ImportPlan | None:
        """Allocate blocks for an imported sequence (prompt + first token); None: no room now."""
        seq = self._sequences(req)[0]
        bs = self.scheduler.config.block_size
        with self.lock:
            need = self.scheduler.allocate_for_import(seq)
        if need is None:
            return None
        n_prompt_blocks = -(-prompt_len // bs)
        hit = seq.num_computed_tokens // bs
        return ImportPlan(req, seq, [i for i in need if i < n_prompt_blocks], hit, n_prompt_blocks)

    def join_import(self, plan: ImportPlan, prompt_len: int) -> None:
        """The plan's KV is loaded: the sequence continues with the next step (engine thread)."""
        assert isinstance(plan.seq, Sequence)
        with self.lock:
            self.scheduler.add_imported(plan.seq, prompt_len)
            plan.joined = True

    def drop_import(self, plan: ImportPlan) -> None:
        assert isinstance(plan.seq, Sequence)
        with self.lock:
            self.scheduler.drop_import(plan.seq)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._siblings.pop(request_id, None)
            self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:  # held hand-over sequences are not work: they wait for release()
        return self.scheduler.has_unfinished or bool(self._siblings)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[TokenOutput | ScoreResult]:
        t0 = time.monotonic()
        with self.lock:
            batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        rows = [_logit_rows(s) for s in batch.scheduled]
        logits = self.runner.run(batch.scheduled, rows)  # [sum(len(rows)), V]

        sampled: dict[int, Sample] = {}
        sample_seqs: list[Sequence] = []
        sample_at: list[int] = []
        i = 0
        for s, chunk_rows in zip(batch.scheduled, rows):
            st = _state(s.seq)
            st.iter_count += 1
            if st.score_from is not None:
                _record_scores(s, chunk_rows, logits[i:i + len(chunk_rows)], st)
            if s.samples:
                sample_seqs.append(s.seq)
                sample_at.append(i + len(chunk_rows) - 1)  # the chunk's last row samples
            i += len(chunk_rows)
        if sample_seqs:
            sampled = self._sample(logits[sample_at], sample_seqs)

        with self.lock:
            results = self.scheduler.update_from_output(
                batch, {seq_id: smp.token_id for seq_id, smp in sampled.items()})
            for seq, token, _ in results:
                if token is not None and seq.request_id in self._siblings:
                    for sibling in self._siblings.pop(seq.request_id):
                        self.scheduler.add(sibling)
            self._measure(batch.num_batched_tokens - len(batch.scheduled), time.monotonic() - t0)
        self._advance_grammars(results)
        now = time.monotonic()
        outputs: list[TokenOutput | ScoreResult] = []
        for seq, token, finish in results:
            st = _state(seq)
            if st.score_from is not None:
                if finish is not None:
                    positions = range(st.score_from, len(seq.token_ids) - 1)  # the extra sampled token is not ours
                    outputs.append(ScoreResult(seq.request_id, [st.scores[p] for p in positions], _aux(seq, now)))
            elif token is not None:
                outputs.append(TokenOutput(seq.request_id, st.index, token, sampled[seq.seq_id], finish,
                                           _aux(seq, now)))
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, Sample]:
        """One token per sequence. A row that cannot be sampled fails its own request (into
        self.failed, aborted here), never the batch: the others are sampled one by one."""
        rows = [_sample_row(seq) for seq in seqs]
        keep = self._constrain(rows, seqs, logits.shape[1])
        if len(keep) < len(seqs):
            logits, seqs, rows = logits[keep], [seqs[j] for j in keep], [rows[j] for j in keep]
            if not seqs:
                return {}
        try:
            return {seq.seq_id: smp for seq, smp in zip(seqs, sample(logits, rows))}
        except Exception:
            log.exception("sampling the batch failed; isolating the row(s) at fault")
        out: dict[int, Sample] = {}
        for j, (seq, row) in enumerate(zip(seqs, rows)):
            try:
                out[seq.seq_id] = sample(logits[j:j + 1], [row])[0]
            except Exception as exc:
                self.failed.append((seq.request_id, RequestError(
                    ErrorCode.INTERNAL, f"this request's sampling failed ({exc}); other requests go on")))
                self.abort(seq.request_id)
        return out

    def _constrain(self, rows: list[SampleRow], seqs: list[Sequence], vocab: int) -> list[int]:
        """Each constrained row's token mask from its grammar (unconstrained rows are left alone); returns
        the rows still to sample: a grammar that fails here fails its own request."""
        constrained = [j for j, seq in enumerate(seqs) if _state(seq).grammar is not None]
        if not constrained:
            return list(range(len(seqs)))
        masks = torch.empty((len(constrained), mask_words(vocab)), dtype=torch.int32)  # [C, ceil(V / 32)]
        failed: set[int] = set()
        for k, j in enumerate(constrained):
            grammar = _state(seqs[j]).grammar
            assert grammar is not None
            try:
                grammar.fill_mask(masks[k])
            except RequestError as exc:
                failed.add(j)
                self._fail(seqs[j].request_id, exc)
                continue
            rows[j].allowed = masks[k]
        return [j for j in range(len(seqs)) if j not in failed]

    def _advance_grammars(self, results: list[tuple[Sequence, int | None, object]]) -> None:
        """Each constrained sequence's grammar takes the token it just got (engine thread, after the step)."""
        for seq, token, _ in results:
            grammar = _state(seq).grammar
            if token is None or grammar is None:
                continue
            if not grammar.advance(token):
                self._fail(seq.request_id, RequestError(
                    ErrorCode.INVALID_ARGUMENT, f"the output cannot follow its grammar: {grammar.error or token}"))

    def _fail(self, request_id: str, error: RequestError) -> None:
        self.failed.append((request_id, error))
        self.abort(request_id)

    def _measure(self, prefill_tokens: int, seconds: float) -> None:
        self.iterations += 1
        ms = seconds * 1000
        self.step_latency_ms = ms if self.iterations == 1 else (1 - _EMA) * self.step_latency_ms + _EMA * ms
        if prefill_tokens > 0:
            rate = prefill_tokens / seconds
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                (1 - _EMA) * self.prefill_tokens_per_s + _EMA * rate

    # ---- load reports (any thread) ----------------------------------------------------------

    def worker_status(self, alive: bool) -> WorkerStatus:
        with self.lock:
            st = self.scheduler.stats()
            return WorkerStatus(
                role=self.role, running=st.num_running, waiting=st.num_waiting,
                queued_prefill_tokens=st.queued_prefill_tokens, step_latency_ms=self.step_latency_ms,
                prefill_tokens_per_s=self.prefill_tokens_per_s, free_blocks=st.free_blocks,
                total_blocks=st.total_blocks, block_size=self.scheduler.config.block_size,
                version=st.version, iterate_count=self.iterations, alive=alive,
                cache_version=self.scheduler.block_pool.cache_version)

    def cache_status(self, since_version: int) -> CacheStatus:
        with self.lock:
            pool = self.scheduler.block_pool
            diff = pool.cache_diff(since_version) if since_version >= 0 else None
            if diff is None:
                return CacheStatus(pool.cache_version, False, pool.cached_keys(), [], [], pool.block_size)
            version, added, removed = diff
            return CacheStatus(version, True, [], added, removed, pool.block_size)


def _state(seq: Sequence) -> _SeqState:
    assert isinstance(seq.payload, _SeqState)
    return seq.payload


def _logit_rows(s: ScheduledSeq) -> list[int]:
    """Chunk-relative rows whose logits this step needs: scored positions, then the sampling row."""
    st = _state(s.seq)
    rows: list[int] = []
    if st.score_from is not None:
        # The logits at position p give the probability of token p + 1.
        first = max(s.start, st.score_from - 1)
        last = min(s.start + s.num_new_tokens, len(s.seq.token_ids) - 1)
        rows = [p - s.start for p in range(first, last)]
    if s.samples and (not rows or rows[-1] != s.num_new_tokens - 1):
        rows.append(s.num_new_tokens - 1)
    return rows


def _record_scores(s: ScheduledSeq, chunk_rows: list[int], logits: torch.Tensor, st: _SeqState) -> None:
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
