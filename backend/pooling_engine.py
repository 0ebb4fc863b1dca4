"""The engine of a pooling model (an encoder): the EngineLoop drives it as it drives the decoder's Engine
(validate / add / abort / step / load reports), but a step is schedule → one padded batch through the
encoder → pool, with no KV cache: an input is done in the step that runs it.

Inputs from every waiting request share a step (FIFO, up to max_num_seqs inputs and
max_num_batched_tokens padded tokens; one input always runs, however long), so a batch of 32 sentences
is one or two forward passes and a single sentence waits for at most the step in flight."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from backend.decoder_pooling import DecoderPoolingModel
from backend.encoder import EncoderModel
from backend.engine_types import (CacheStatus, GenerationRequest, KVLayout, PoolingRequest,
                                  PoolingResult, Pooled, PoolTask, ScoreRequest)
from backend.pooling import run_task
from backend.step_stats import StepStats
from backend.step_threads import SMALL_STEP_TOKENS, StepThreads
from backend.validation import check_token_ids
from kvyard.aux_info import AuxInfo
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_POOL_ITEMS
from kvyard.pooling_model import ModelKind, PoolingSpec
from kvyard.roles import Role
from kvyard.worker_status import WorkerStatus

# What each kind of model can be asked (the frontend refuses the rest first, naming the route).
_TASKS = {ModelKind.EMBED: (PoolTask.EMBED, PoolTask.SPARSE, PoolTask.COLBERT), ModelKind.CLASSIFY: (PoolTask.CLASSIFY,)}


@dataclass(eq=False)  # by identity: a step groups its inputs by request
class _Running:
    """A request being pooled: its answers fill in as its inputs run."""
    request: PoolingRequest
    outputs: list[Pooled | None]
    remaining: int
    iter_count: int = 0
    first_scheduled: float | None = None


class PoolingEngine:
    """Only the engine loop thread calls add / abort / step; load reports from other threads take `lock`."""

    def __init__(self, model: EncoderModel | DecoderPoolingModel, model_name: str, max_num_seqs: int, max_num_batched_tokens: int,
                 block_size: int = 16, role: Role = Role.PDFUSION) -> None:
        self.model = model
        self.spec: PoolingSpec = model.spec
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.role = role
        self.max_model_len = self.spec.max_len
        self.vocab_size = model.cfg.vocab_size
        self.lock = threading.Lock()
        self.stats = StepStats()
        self.failed: list[tuple[str, RequestError]] = []
        self.num_preemptions = 0  # nothing is ever preempted: no KV to run out of
        self._requests: dict[str, _Running] = {}
        self._pending: deque[tuple[_Running, int]] = deque()  # (request, item index), FIFO
        self._running = 0
        self._version = 0
        # backend/step_threads.py: small steps and large ones each on the thread count measured cheaper
        threads = torch.get_num_threads()
        self._threads = (StepThreads(threads, first=1), StepThreads(threads)) if model.device.type == "cpu" else None

    def kv_layout(self) -> KVLayout:
        return KVLayout(block_size=self.block_size, dtype=str(self.model.dtype).removeprefix("torch."),
                        block_shape=(0,), itemsize=0)

    # ---- requests in ------------------------------------------------------------------------

    def validate(self, req: PoolingRequest | GenerationRequest | ScoreRequest) -> None:
        """Raises RequestError for input this engine can never serve. Pure: safe from any thread."""
        kind = self.spec.kind
        if not isinstance(req, PoolingRequest):
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"model {self.model_name!r} is {kind.a}: it cannot generate text", "model")
        if req.task not in _TASKS[kind] or (kind is ModelKind.EMBED and req.task is not PoolTask.EMBED
                                            and not self.spec.has_head(req.task.value)):
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"model {self.model_name!r} ({kind}, heads: {', '.join(self.spec.heads)}) "
                               f"has no {req.task} output", "model")
        if not 1 <= len(req.items) <= MAX_POOL_ITEMS:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"a request pools 1 to {MAX_POOL_ITEMS} inputs, got {len(req.items)}", "input")
        for i, item in enumerate(req.items):
            if not item.token_ids:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"input {i} has no tokens", "input")
            if len(item.token_ids) > self.max_model_len:
                raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                   f"input {i} has {len(item.token_ids)} tokens; this model takes at most "
                                   f"{self.max_model_len}", "input")
            if not 0 <= item.pair_start < len(item.token_ids):
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"input {i}: pair_start {item.pair_start} "
                                   f"is outside its {len(item.token_ids)} tokens", "input")
            check_token_ids(item.token_ids, self.vocab_size)

    def add(self, req: PoolingRequest) -> None:
        running = _Running(req, [None] * len(req.items), len(req.items))
        with self.lock:
            self._requests[req.request_id] = running
            self._pending.extend((running, i) for i in range(len(req.items)))
            self._version += 1

    def abort(self, request_id: str) -> None:
        with self.lock:
            if self._requests.pop(request_id, None) is not None:
                self._pending = deque(p for p in self._pending if p[0].request.request_id != request_id)
                self._version += 1

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[PoolingResult]:
        t0 = time.monotonic()
        with self.lock:
            batch = self._schedule()
            self._running = len(batch)
        if not batch:
            return []
        outputs: list[PoolingResult] = []
        for task in dict.fromkeys(r.request.task for r, _ in batch):  # one pass per task asked this step
            group = [(r, i) for r, i in batch if r.request.task is task]
            for (running, i), pooled in zip(group, self._run(task, group)):
                running.outputs[i] = pooled
                running.remaining -= 1
        now = time.monotonic()
        with self.lock:
            for running in dict.fromkeys(r for r, _ in batch):
                running.iter_count += 1
                if running.remaining == 0 and self._requests.pop(running.request.request_id, None) is not None:
                    outputs.append(PoolingResult(running.request.request_id,
                                                 [o for o in running.outputs if o is not None],
                                                 _aux(running, now)))
            self._running = 0
            self._version += 1
            self.stats.measure(sum(len(r.request.items[i].token_ids) for r, i in batch), now - t0)
        return outputs

    def _schedule(self) -> list[tuple[_Running, int]]:
        """FIFO inputs while the padded batch fits the step's budget (the first always runs)."""
        batch: list[tuple[_Running, int]] = []
        longest = 0
        now = time.monotonic()
        while self._pending and len(batch) < self.max_num_seqs:
            running, i = self._pending[0]
            n = len(running.request.items[i].token_ids)
            if batch and max(longest, n) * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            self._pending.popleft()
            longest = max(longest, n)
            if running.first_scheduled is None:
                running.first_scheduled = now
            batch.append((running, i))
        return batch

    def _run(self, task: PoolTask, group: list[tuple[_Running, int]]) -> list[Pooled]:
        """The group as one right-padded batch: ids, segment ids and the mask [B, T]."""
        items = [r.request.items[i] for r, i in group]
        T = max(len(it.token_ids) for it in items)
        ids = torch.zeros((len(items), T), dtype=torch.long)
        type_ids = torch.zeros_like(ids)
        mask = torch.zeros((len(items), T), dtype=torch.bool)
        segments = self.model.cfg.type_vocab_size > 1
        for b, it in enumerate(items):
            n = len(it.token_ids)
            ids[b, :n] = torch.tensor(it.token_ids)
            mask[b, :n] = True
            if it.pair_start and segments:
                type_ids[b, it.pair_start:n] = 1
        device = self.model.device
        if self._threads is None:
            return run_task(self.model, task, ids.to(device), type_ids.to(device), mask.to(device))
        before = torch.get_num_threads()
        large = ids.numel() > SMALL_STEP_TOKENS
        chooser = self._threads[large]
        threads = chooser.choose()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            return run_task(self.model, task, ids, type_ids, mask)
        finally:  # small steps compared per step (mostly streaming the weights), large ones per padded token
            chooser.measured(threads, (time.perf_counter() - t0) / (ids.numel() if large else 1))
            torch.set_num_threads(before)

    # ---- load reports (any thread) ----------------------------------------------------------

    def worker_status(self, alive: bool) -> WorkerStatus:
        """Inputs stand in for sequences; the 'KV blocks' are room for the largest request, always free (an
        encoder holds nothing between steps), so the master's room checks always pass."""
        with self.lock:
            blocks = -(-MAX_POOL_ITEMS * self.max_model_len // self.block_size)
            return WorkerStatus(
                role=self.role, running=self._running, waiting=len(self._pending),
                queued_prefill_tokens=sum(len(r.request.items[i].token_ids) for r, i in self._pending),
                step_latency_ms=self.stats.step_latency_ms, prefill_tokens_per_s=self.stats.prefill_tokens_per_s,
                free_blocks=blocks, total_blocks=blocks, block_size=self.block_size, version=self._version,
                iterate_count=self.stats.iterations, alive=alive, cache_version=0, model_kind=self.spec.kind)

    def cache_status(self, since_version: int) -> CacheStatus:
        return CacheStatus(0, False, [], [], [], self.block_size)  # no prefix cache


def _aux(running: _Running, now: float) -> AuxInfo:
    req = running.request
    started = running.first_scheduled or now
    return AuxInfo(input_len=sum(len(it.token_ids) for it in req.items), output_len=0,
                   iter_count=running.iter_count, reuse_len=0,
                   cost_time_us=int((now - req.arrival_time) * 1e6),
                   first_token_cost_time_us=int((now - req.arrival_time) * 1e6),
                   wait_time_us=int((started - req.arrival_time) * 1e6))
