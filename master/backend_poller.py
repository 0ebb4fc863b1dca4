"""Master → backend gRPC edge: worker status (kvyard.worker_status) and prefix-cache keys as plain dataclasses,
checked for sanity (no protobuf past here)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from kvyard.cluster_auth import grpc_metadata
from kvyard.grpc_keepalive import CLIENT_OPTIONS
from kvyard.pooling_model import ModelKind
from kvyard.roles import WORKER_ROLES, Role
from kvyard.worker_status import WorkerStatus
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

_MAX_KEY = 2**63 - 1


@dataclass(frozen=True)
class CacheUpdate:
    """The backend's cached block keys: the full set, or a diff since the version we asked from."""
    version: int
    is_diff: bool
    keys: frozenset[int]         # the full set (is_diff False)
    added: frozenset[int]        # since the asked version (is_diff True)
    removed: frozenset[int]
    block_size: int


class StatusError(Exception):
    """A poll failed. `definitive`: the backend answered nonsense or refused the connection, so it is
    out of routing at once; otherwise (a timeout) it stays in until it has been silent for the expiry."""

    def __init__(self, message: str, definitive: bool) -> None:
        super().__init__(message)
        self.definitive = definitive


class BackendPoller:
    """The status RPCs of one backend over one channel."""

    def __init__(self, address: str, timeout_s: float, token: str = "") -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = grpc_metadata(token)  # the cluster token
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            *CLIENT_OPTIONS,
        ])
        self._stub = pb_grpc.ModelRpcServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def worker_status(self) -> WorkerStatus:
        msg = await self._call(self._stub.GetWorkerStatus, pb.WorkerStatusRequestPB(latest_version=-1))
        return worker_status_from_pb(msg)

    async def cache_status(self, since_version: int) -> CacheUpdate:
        msg = await self._call(self._stub.GetCacheStatus, pb.CacheStatusRequestPB(since_version=since_version))
        return cache_update_from_pb(msg, since_version)

    async def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=self.timeout_s, wait_for_ready=False, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            definitive = code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            raise StatusError(f"{code.name}: {exc.details()}", definitive) from None


def worker_status_from_pb(m: pb.WorkerStatusPB) -> WorkerStatus:
    """Raises StatusError(definitive) for a report no real backend would send."""
    problems = []
    if m.role not in WORKER_ROLES:
        problems.append(f"role {m.role!r}")
    for name in ("running", "waiting", "queued_prefill_tokens", "free_blocks", "iterate_count", "cache_version"):
        if getattr(m, name) < 0:
            problems.append(f"{name}={getattr(m, name)}")
    for name in ("step_latency_ms", "prefill_tokens_per_s"):
        value = getattr(m, name)
        if not math.isfinite(value) or value < 0:
            problems.append(f"{name}={value}")
    if m.block_size <= 0 or m.total_blocks <= 0 or m.free_blocks > m.total_blocks:
        problems.append(f"blocks free={m.free_blocks} total={m.total_blocks} size={m.block_size}")
    if m.model_kind not in ("", *ModelKind):
        problems.append(f"model_kind {m.model_kind!r}")
    if problems:
        raise StatusError("garbage worker status: " + ", ".join(problems), definitive=True)
    return WorkerStatus(role=Role(m.role), running=m.running, waiting=m.waiting,
                        queued_prefill_tokens=m.queued_prefill_tokens, step_latency_ms=m.step_latency_ms,
                        prefill_tokens_per_s=m.prefill_tokens_per_s, free_blocks=m.free_blocks,
                        total_blocks=m.total_blocks, block_size=m.block_size, version=m.version,
                        iterate_count=m.iterate_count, alive=m.alive, cache_version=m.cache_version,
                        model_kind=ModelKind(m.model_kind or ModelKind.GENERATE),  # older backends: none
                        adapters=tuple(m.adapters))


def cache_update_from_pb(m: pb.CacheStatusPB, since_version: int) -> CacheUpdate:
    keys, added, removed = frozenset(m.cached_keys), frozenset(m.added_keys), frozenset(m.removed_keys)
    bad_key = next((k for k in (*keys, *added, *removed) if not 0 <= k <= _MAX_KEY), None)
    if m.block_size <= 0 or m.version < 0 or bad_key is not None:
        raise StatusError(f"garbage cache status: version={m.version} block_size={m.block_size} "
                          f"key={bad_key}", definitive=True)
    if m.is_diff and since_version < 0:
        raise StatusError("garbage cache status: a diff answered to a request for the full set", True)
    return CacheUpdate(m.version, m.is_diff, keys, added, removed, m.block_size)
