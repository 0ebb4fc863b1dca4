"""The continuous-batching scheduler: picks each engine step's tokens (decodes, prefill chunks) under a token budget.

vLLM-v1 style: there is no prefill/decode phase, only "each sequence computes
token_ids[num_computed_tokens:]" and a per-step token budget. Running sequences are served first,
then waiting ones are admitted first-come-first-served; a long prompt is cut into chunks so it
shares steps with decodes. When a running sequence cannot get a block to grow, the most recently
admitted running sequence is preempted by recompute (blocks freed, requeued at the front of the
waiting queue, its prompt + output recomputed later, cheaply when the prefix cache still holds it).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from backend.block_pool import BlockPool
from backend.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int                       # KV blocks in the pool (sized by the engine from free device memory)
    block_size: int = 16                  # tokens per KV block
    max_num_seqs: int = 64                # most sequences running (holding blocks, scheduled) at once
    max_num_batched_tokens: int = 2048    # token budget of one step, decodes and prefill chunks together
    long_prefill_token_threshold: int = 0  # cap on one prefill chunk per step so several prompts share a step; 0 = no cap

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int            # == seq.num_computed_tokens at schedule time: the first position computed this step
    num_new_tokens: int   # tokens computed this step: seq.token_ids[start:start + num_new_tokens]
    samples: bool         # True when this chunk reaches the end of seq.token_ids: the model samples one token for it


@dataclass
class SchedulerOutput:
    # Entries with num_new_tokens == 1 (decodes: query length 1) first, then longer prefill chunks;
    # within each group running sequences precede newly admitted ones, in admission order.
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0                                 # sum of num_new_tokens
    preempted: list[Sequence] = field(default_factory=list)     # sent back to waiting this step (KV dropped)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int            # sequences holding blocks
    num_waiting: int            # sequences queued (new or preempted)
    queued_prefill_tokens: int  # tokens still to compute for prefills, waiting and running
    free_blocks: int            # free KV blocks (including free-but-cached ones)
    total_blocks: int           # KV blocks in the pool
    version: int                # bumps on every scheduler state change (cheap "did anything change")


@dataclass(frozen=True)
class StepResult:
    """One sampling entry's outcome of a step, for a sequence that was still running."""
    seq: Sequence
    token: int                          # the token sampled and appended this step
    finish_reason: FinishReason | None  # set when that token ended the sequence


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config: SchedulerConfig = config
        self.block_pool: BlockPool = BlockPool(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()  # FCFS; preempted sequences are put back at the front
        self.running: list[Sequence] = []        # admission order: the last one is the first preempted
        self.num_preemptions = 0                 # since start, for /metrics (read from other threads: an int)
        self._clock: Callable[[], float] = clock  # injectable so tests control timestamps
        self._version: int = 0
        self.held: dict[int, Sequence] = {}     # finished but holding blocks for a KV hand-over

    # ---- queue management ---------------------------------------------------------------------

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens could run with the whole pool to itself."""
        return self.block_pool.blocks_needed(num_tokens) <= self.block_pool.num_total_blocks

    @property
    def token_capacity(self) -> int:
        return self.block_pool.num_total_blocks * self.config.block_size

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"only fresh sequences can be added: {seq!r}")
        if not self.fits_ever(len(seq.token_ids)):
            # Admitting it would block the FCFS queue forever.
            raise ValueError(f"{len(seq.token_ids)} tokens can never fit {self.token_capacity} KV slots")
        self.waiting.append(seq)
        self._version += 1

    def abort(self, request_id: str) -> list[Sequence]:
        """Remove every sequence of request_id, free its blocks, mark it FINISHED/ABORT; returns them."""
        removed = [s for s in self.waiting if s.request_id == request_id]
        if removed:
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        aborted_running = [s for s in self.running if s.request_id == request_id]
        if aborted_running:
            self.running = [s for s in self.running if s.request_id != request_id]
            for seq in aborted_running:
                self.block_pool.free(seq)
            removed += aborted_running
        for seq in removed:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
        if removed:
            self._version += 1
        return removed

    # ---- one step -----------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_pool.free(seq)  # also zeroes num_computed_tokens
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, num_new: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Make room for seq to compute num_new tokens, preempting the latest admitted unscheduled seqs.

        Returns False when seq itself had to go (it was the latest admitted one still unscheduled).
        """
        while not self.block_pool.can_append(seq, num_new):
            # Entries already in this step's output cannot be taken back, so the victim is the
            # latest admitted sequence not scheduled yet, as in nano-vllm; that is seq itself only
            # when no later-admitted one is left.
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled_ids)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.block_pool.append_slots(seq, num_new)
        return True

    def _chunk(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold and n > 1:
            n = min(n, threshold)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        now = self._clock()

        def emit(seq: Sequence, n: int) -> None:
            nonlocal budget
            end = seq.num_computed_tokens + n
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n, end == len(seq.token_ids)))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now

        # 1. Running decodes first, so a long prefill can never starve them of budget.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                i += 1
                continue
            if not self._reserve(seq, 1, scheduled_ids, out):
                break  # seq preempted itself: everything after it is gone too
            emit(seq, 1)
            i += 1

        # 2. Running prefills (chunks of prompts admitted earlier, or recomputes after preemption).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            if seq.seq_id in scheduled_ids or remaining <= 1:
                i += 1
                continue
            n = self._chunk(remaining, budget)
            # Blocks for the whole sequence were taken at admission, so this preempts nothing in
            # practice; kept for safety should that invariant change.
            if not self._reserve(seq, n, scheduled_ids, out):
                break
            emit(seq, n)
            i += 1

        # 3. Admit waiting sequences, FCFS, unless this step already had to preempt (memory is tight).
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not self.block_pool.can_allocate(seq):
                break  # no skipping ahead: a big prompt at the head must not starve
            self.waiting.popleft()
            self.block_pool.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            emit(seq, self._chunk(len(seq.token_ids) - seq.num_computed_tokens, budget))

        # Query-length-1 entries first (stable), so the model runner sees one decode run and one prefill run.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if out.scheduled or out.preempted:
            self._version += 1
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[int, int]) -> list[StepResult]:
        """Apply one executed step: advance KV, cache full blocks, append sampled tokens, finish sequences.

        `sampled` maps seq_id -> token for every entry with samples=True. Sequences aborted between
        schedule() and this call are skipped (abort() already reported them). Returns a
        StepResult for every sampling entry that was still running.
        """
        results: list[StepResult] = []
        finished = False
        now = self._clock()
        for entry in out.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            assert seq.num_computed_tokens == entry.start, f"{seq!r} moved since schedule()"
            seq.num_computed_tokens = entry.start + entry.num_new_tokens
            self.block_pool.cache_computed_blocks(seq)
            if not entry.samples:
                continue
            token = sampled[seq.seq_id]
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = seq.check_stop()
            if reason is None and len(seq.token_ids) > self.token_capacity:
                # Its next step would need more KV than the whole pool holds.
                reason = FinishReason.LENGTH
            if reason is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                if seq.hold_blocks:
                    self.held[seq.seq_id] = seq  # a prefill hand-over still reads them: release() frees
                else:
                    self.block_pool.free(seq)
                finished = True
            results.append(StepResult(seq, token, reason))
        if finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        self._version += 1
        return results

    # ---- prefill/decode hand-over --------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a finished sequence that was held for a KV hand-over."""
        if self.held.pop(seq.seq_id, None) is not None:
            self.block_pool.free(seq)
            self._version += 1

    def allocate_for_import(self, seq: Sequence) -> list[int] | None:
        """Decode side: blocks for seq's tokens now (prefix hits by key included). Returns the indices
        of the prompt blocks whose KV must be loaded, or None when the pool has no room now."""
        if not self.block_pool.can_allocate(seq):
            return None
        self.block_pool.allocate(seq)
        hit_blocks = seq.num_computed_tokens // self.config.block_size
        self._version += 1
        return list(range(hit_blocks, len(seq.block_table)))

    def add_imported(self, seq: Sequence, num_computed: int) -> None:
        """Decode side: seq holds blocks whose KV for the first num_computed tokens is loaded; it joins
        the running batch and continues from there."""
        seq.num_computed_tokens = num_computed
        self.block_pool.cache_computed_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._version += 1

    def drop_import(self, seq: Sequence) -> None:
        """Decode side: a hand-over failed before add_imported; give its blocks back."""
        self.block_pool.free(seq)
        self._version += 1

    # ---- observability ------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        queued = sum(len(s.token_ids) - s.num_computed_tokens for s in self.waiting)
        for s in self.running:
            remaining = len(s.token_ids) - s.num_computed_tokens
            if remaining > 1:  # a decode's single token is not prefill work
                queued += remaining
        pool = self.block_pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            queued_prefill_tokens=queued,
            free_blocks=pool.num_free_blocks,
            total_blocks=pool.num_total_blocks,
            version=self._version,
        )
