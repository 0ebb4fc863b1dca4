"""RTP-LLM's debug answers in its shapes (/worker_status's WorkStatus, /cache_status's CacheStatus), built from
the backend's own types; kvyard's own fields stay beside them so nothing that read them before breaks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.engine_types import CacheStatus
from backend.task_log import TaskLog
from kvyard.errors import ErrorCode, RequestError, refuse_unknown_fields
from kvyard.worker_status import WorkerStatus

# The request fields, with RTP-LLM's spellings ("lastest", "finised") accepted beside the right ones.
CACHE_VERSION_KEYS = ("latest_cache_version", "lastest_cache_version")
FINISHED_VERSION_KEYS = ("latest_finished_version", "latest_finised_version")


@dataclass(frozen=True)
class BackendFacts:
    """What a backend knows about itself that its engine does not report."""
    server_port: int = 0         # START_PORT (a backend-only process's health/debug app)
    grpc_port: int = 0           # START_PORT + 1
    http_port: int = 0           # START_PORT + 5
    max_concurrency: int = 0     # MAX_NUM_SEQS: sequences it runs at once


def version_arg(body: dict[str, Any] | None, keys: tuple[str, ...], known: tuple[str, ...] = ()) -> int:
    """The version a poller last saw (-1: none), under either spelling; a non-integer is a 400 naming it, as
    is a key neither `keys` nor `known` (the route's other request fields) holds."""
    refuse_unknown_fields(body or {}, {*keys, *known}, f" (this route takes {', '.join(keys + known)})")
    for key in keys:
        value = (body or {}).get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{key} must be an integer, got {value!r}", key)
        return value
    return -1


def cache_counts(status: WorkerStatus) -> dict[str, int]:
    """The KV cache in tokens (RTP-LLM's available_kv_cache / total_kv_cache) and in blocks."""
    return {"available_kv_cache": status.free_blocks * status.block_size,
            "total_kv_cache": status.total_blocks * status.block_size,
            "block_size": status.block_size, "free_blocks": status.free_blocks,
            "total_blocks": status.total_blocks}


def cache_status_view(status: WorkerStatus, full: CacheStatus, diff: CacheStatus | None, since: int) -> dict[str, Any]:
    """`cached_keys`: every block key held, when the cache moved past `since` (None when it did not);
    `added_keys`/`removed_keys`: the change since `since` when the backend still knows it (`is_diff`)."""
    moved = full.version != since
    return {**cache_counts(status), "version": full.version, "latest_cache_version": full.version,
            "lastest_cache_version": full.version,
            "cached_keys": full.cached_keys if moved else None,
            "is_diff": bool(diff and diff.is_diff),
            "added_keys": diff.added_keys if diff and diff.is_diff else [],
            "removed_keys": diff.removed_keys if diff and diff.is_diff else []}


def worker_status_view(status: WorkerStatus, tasks: TaskLog, facts: BackendFacts, finished_since: int) -> dict[str, Any]:
    """RTP-LLM's WorkStatus. `version` is the task log's: pass it back as latest_finished_version to get
    only the tasks finished since. The prefix cache's keys are not here (they need the cluster token:
    /cache_status), only its size."""
    busy = status.running + status.waiting
    return {
        "role": status.role.value,
        "server_port": facts.server_port, "http_proto_port": facts.http_port, "grpc_proto_port": facts.grpc_port,
        "available_concurrency": max(0, facts.max_concurrency - busy),
        "running_task_info": [t.view() for t in tasks.running()],
        "finished_task_list": [t.view() for t in tasks.finished_since(finished_since)],
        "step_latency_ms": status.step_latency_ms, "iterate_count": status.iterate_count,
        "dp_size": 1, "tp_size": 1, "alive": status.alive,
        "version": tasks.version, "latest_finished_version": tasks.version,
        "cache_status": {**cache_counts(status), "version": status.cache_version, "cached_keys": None},
        "profile_meta": None,
        # kvyard's own load report, as before
        "running": status.running, "waiting": status.waiting, "queued_prefill_tokens": status.queued_prefill_tokens,
        "prefill_tokens_per_s": status.prefill_tokens_per_s, "free_blocks": status.free_blocks,
        "total_blocks": status.total_blocks, "block_size": status.block_size, "scheduler_version": status.version,
        "cache_version": status.cache_version,
    }
