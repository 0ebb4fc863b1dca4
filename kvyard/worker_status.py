"""A backend's load report, one type on both ends of GetWorkerStatus: the engine builds it, the master polls
and routes on it (backend/pb_convert.py and master/backend_poller.py convert it at the gRPC edge)."""
from __future__ import annotations

from dataclasses import dataclass

from kvyard.pooling_model import ModelKind
from kvyard.roles import Role


@dataclass(frozen=True)
class WorkerStatus:
    role: Role                   # PDFUSION, PREFILL or DECODE
    running: int                 # sequences holding KV blocks
    waiting: int                 # sequences queued
    queued_prefill_tokens: int   # prompt tokens still to compute
    step_latency_ms: float       # recent engine step time
    prefill_tokens_per_s: float  # recent prefill throughput (0 = not measured yet)
    free_blocks: int             # free KV blocks
    total_blocks: int            # KV blocks in the pool
    block_size: int              # tokens per block
    version: int                 # bumps on every scheduler state change
    iterate_count: int           # engine steps since start (drops when the backend restarted)
    alive: bool                  # its engine thread runs
    cache_version: int           # the prefix cache's version: fetch a diff of its keys when it moved
    model_kind: ModelKind = ModelKind.GENERATE  # what its model answers: generate, embed or classify
    adapters: tuple[str, ...] = ()  # LoRA adapters it holds, by name (docs/lora.md)
