"""The backend's step loop: schedule → run the model → sample → hand tokens back to the scheduler."""
from __future__ import annotations

import logging
import threading
import time

import torch

from backend.constraints import GrammarState, mask_words
from backend.lora import LoraRegistry
from backend.engine_types import (CacheStatus, GenerationRequest, ImportPlan, KVLayout, PoolingRequest, ScoreRequest,
                                  ScoreResult, TokenOutput)
from backend.model_runner import ModelRunner
from backend.sampler import Sample, SampleRow, sample
from backend.scheduler import Scheduler, SchedulerOutput, StepResult
from backend.scoring import ScoreState, logit_rows, record_scores, score_result, score_sequence
from backend.sequence import Sequence
from backend.siblings import Siblings, request_sequences
from backend.step_stats import StepStats
from backend.validation import validate_request
from backend.vision_inputs import attach_images, check_images, salt_images
from backend.image_tower import ImageTower
from kvyard.aux_info import AuxInfo
from kvyard.errors import ErrorCode, RequestError
from kvyard.roles import Role
from kvyard.vision_config import ImageSide
from kvyard.worker_status import WorkerStatus

log = logging.getLogger("kvyard.engine")


class Engine:
    """Only the engine loop thread calls add / abort / step; status readers from other threads take
    `lock`, which step holds only while the scheduler's state changes (not during the forward pass)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, vocab_size: int,
                 max_model_len: int, role: Role = Role.PDFUSION, vision: ImageSide | None = None,
                 tower: ImageTower | None = None, loras: LoraRegistry | None = None) -> None:
        """vision: a vision-language model's image side (None: text only); tower: where images are embedded
        here (None on a DECODE backend: it takes the prefilled KV); loras: the LoRA adapters it serves (None:
        none can be loaded)."""
        self.runner = runner
        self.vision = vision
        self.tower = tower
        self.loras = loras
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.role = role
        self.lock = threading.Lock()  # the scheduler against load reports read on other threads (HTTP, metrics)
        self.siblings = Siblings()
        self.stats = StepStats()
        # Requests a step failed on their own (the batch went on); the engine loop reports and drains it.
        self.failed: list[tuple[str, RequestError]] = []

    def kv_layout(self) -> KVLayout:
        return self.runner.cache.layout()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- requests in ------------------------------------------------------------------------

    def validate(self, req: GenerationRequest | ScoreRequest | PoolingRequest) -> None:
        """Raises RequestError for input this engine can never serve. Safe from any thread: it also resolves
        the LoRA adapter a generation or score request names (req.adapter), which the request then holds."""
        if isinstance(req, PoolingRequest):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "this backend serves a generate model: it has no "
                               "pooling (embeddings, reranking, classification)", "model")
        validate_request(req, self.vocab_size, self.max_model_len, self.scheduler)
        if isinstance(req, GenerationRequest):
            check_images(req.prompt_ids, req.images, self.vision)
        name = req.sampling.adapter if isinstance(req, GenerationRequest) else req.adapter_name
        if name and req.adapter is None:
            if self.role is not Role.PDFUSION:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the LoRA adapter {name!r}: adapters are not "
                                   f"served by a prefill/decode split (this backend is {self.role.value}); send "
                                   "it to a PDFUSION backend", "model")
            if self.loras is None:
                raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"the LoRA adapter {name!r} is not loaded: this "
                                   "backend serves no adapters", "model")
            req.adapter = self.loras.resolve(name)

    def add(self, req: GenerationRequest | ScoreRequest) -> None:
        if isinstance(req, ScoreRequest):
            seq = score_sequence(req)
            with self.lock:
                self.scheduler.add(seq)
            return
        seqs = request_sequences(req, self.runner.device)
        attach_images(seqs, req.images, self.vision, self.tower, self.scheduler.config.block_size)
        with self.lock:
            self.siblings.add(self.scheduler, seqs)

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
        seq = request_sequences(req, self.runner.device)[0]
        bs = self.scheduler.config.block_size
        salt_images([seq], req.images, self.vision, bs)  # the prefill side's keys: the same images' digests
        with self.lock:
            need = self.scheduler.allocate_for_import(seq)
        if need is None:
            return None
        n_prompt_blocks = -(-prompt_len // bs)
        hit = seq.num_computed_tokens // bs
        return ImportPlan(req, seq, [i for i in need if i < n_prompt_blocks], hit, n_prompt_blocks)

    def join_import(self, plan: ImportPlan, prompt_len: int) -> None:
        """The plan's KV is loaded: the sequence continues with the next step (engine thread)."""
        with self.lock:
            self.scheduler.add_imported(plan.seq, prompt_len)
            plan.joined = True

    def drop_import(self, plan: ImportPlan) -> None:
        with self.lock:
            self.scheduler.drop_import(plan.seq)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.siblings.drop(request_id)
            self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:  # held hand-over sequences are not work: they wait for release()
        return self.scheduler.has_unfinished or bool(self.siblings)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[TokenOutput | ScoreResult]:
        t0 = time.monotonic()
        with self.lock:
            batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        rows = [logit_rows(s) for s in batch.scheduled]
        logits = self.runner.run(batch.scheduled, rows)  # [sum(len(rows)), V]
        sampled = self._sample_step(batch, rows, logits)
        with self.lock:
            results = self.scheduler.update_from_output(
                batch, {seq_id: smp.token_id for seq_id, smp in sampled.items()})
            self.siblings.admit(self.scheduler, results)
            self.stats.measure(batch.num_batched_tokens - len(batch.scheduled), time.monotonic() - t0)
        return self._postprocess(results, sampled)

    def _sample_step(self, batch: SchedulerOutput, rows: list[list[int]], logits: torch.Tensor
                     ) -> dict[int, Sample]:
        """Scores the scoring rows, samples one token for each entry that samples (by seq_id)."""
        sample_seqs: list[Sequence] = []
        sample_at: list[int] = []
        i = 0
        for s, chunk_rows in zip(batch.scheduled, rows):
            s.seq.iter_count += 1
            if s.seq.feature(ScoreState) is not None:
                record_scores(s, chunk_rows, logits[i:i + len(chunk_rows)])
            if s.samples:
                sample_seqs.append(s.seq)
                sample_at.append(i + len(chunk_rows) - 1)  # the chunk's last row samples
            i += len(chunk_rows)
        return self._sample(logits[sample_at], sample_seqs) if sample_seqs else {}

    def _postprocess(self, results: list[StepResult], sampled: dict[int, Sample]) -> list[TokenOutput | ScoreResult]:
        """Grammars take their tokens; each sampled token (or finished scoring) becomes an output."""
        self._advance_grammars(results)
        now = time.monotonic()
        outputs: list[TokenOutput | ScoreResult] = []
        for r in results:
            seq = r.seq
            if seq.feature(ScoreState) is not None:
                if r.finish_reason is not None:
                    outputs.append(score_result(seq, _aux(seq, now)))
            else:
                outputs.append(TokenOutput(seq.request_id, seq.index, r.token, sampled[seq.seq_id],
                                           r.finish_reason, _aux(seq, now)))
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, Sample]:
        """One token per sequence. A row that cannot be sampled fails its own request (into
        self.failed, aborted here), never the batch: the others are sampled one by one."""
        rows = [SampleRow(seq.sampling, seq.generator, seq.prompt_token_ids, seq.output_token_ids,
                          suppressed=_suppressed(seq)) for seq in seqs]
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
        constrained = [j for j, seq in enumerate(seqs) if seq.feature(GrammarState) is not None]
        if not constrained:
            return list(range(len(seqs)))
        masks = torch.empty((len(constrained), mask_words(vocab)), dtype=torch.int32)  # [C, ceil(V / 32)]
        failed: set[int] = set()
        for k, j in enumerate(constrained):
            grammar = seqs[j].feature(GrammarState)
            assert grammar is not None
            try:
                grammar.fill_mask(masks[k])
            except RequestError as exc:
                failed.add(j)
                self._fail(seqs[j].request_id, exc)
                continue
            rows[j].allowed = masks[k]
        return [j for j in range(len(seqs)) if j not in failed]

    def _advance_grammars(self, results: list[StepResult]) -> None:
        """Each constrained sequence's grammar takes the token it just got (engine thread, after the step)."""
        for r in results:
            grammar = r.seq.feature(GrammarState)
            if grammar is not None and not grammar.advance(r.token):
                self._fail(r.seq.request_id, RequestError(
                    ErrorCode.INVALID_ARGUMENT, f"the output cannot follow its grammar: {grammar.error or r.token}"))

    def _fail(self, request_id: str, error: RequestError) -> None:
        self.failed.append((request_id, error))
        self.abort(request_id)

    # ---- load reports (any thread) ----------------------------------------------------------

    def worker_status(self, alive: bool) -> WorkerStatus:
        with self.lock:
            st = self.scheduler.stats()
            return WorkerStatus(
                role=self.role, running=st.num_running, waiting=st.num_waiting,
                queued_prefill_tokens=st.queued_prefill_tokens, step_latency_ms=self.stats.step_latency_ms,
                prefill_tokens_per_s=self.stats.prefill_tokens_per_s, free_blocks=st.free_blocks,
                total_blocks=st.total_blocks, block_size=self.scheduler.config.block_size,
                version=st.version, iterate_count=self.stats.iterations, alive=alive,
                cache_version=self.scheduler.block_pool.cache_version,
                adapters=() if self.loras is None else tuple(self.loras.names()))

    def cache_status(self, since_version: int) -> CacheStatus:
        with self.lock:
            pool = self.scheduler.block_pool
            diff = pool.cache_diff(since_version) if since_version >= 0 else None
            if diff is None:
                return CacheStatus(pool.cache_version, False, pool.cached_keys(), [], [], pool.block_size)
            version, added, removed = diff
            return CacheStatus(version, True, [], added, removed, pool.block_size)


def _aux(seq: Sequence, now: float) -> AuxInfo:
    def us(t: float | None) -> int:
        return int(((t if t is not None else now) - seq.arrival_time) * 1e6)
    return AuxInfo(input_len=seq.num_prompt_tokens, output_len=seq.num_output_tokens,
                   iter_count=seq.iter_count, reuse_len=seq.num_cached_tokens,
                   cost_time_us=us(now), first_token_cost_time_us=us(seq.first_token_time),
                   wait_time_us=us(seq.first_scheduled_time))


def _suppressed(seq: Sequence) -> tuple[int, ...]:
    """Before min_new_tokens, the ids that would stop the sequence may not be sampled at all (as in vLLM):
    its stop token ids, and eos unless ignore_eos."""
    stop = seq.stop
    if seq.num_output_tokens >= stop.min_new_tokens:
        return ()
    return (*stop.stop_token_ids, *(() if stop.ignore_eos else stop.eos_token_ids))
