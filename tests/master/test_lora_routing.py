"""The master routes a request for a LoRA adapter to the backends that hold it (pure policy, no model): their
load reports name the adapters, the schedule request names the one it wants."""
from __future__ import annotations

from backend.pb_convert import worker_status_to_pb
from kvyard.errors import ErrorCode
from kvyard.roles import Role
from kvyard.worker_status import WorkerStatus
from master.backend_poller import worker_status_from_pb
from master.policy import BackendLoad, RouteRequest, choose_backend


def load(name: str, running: int, adapters: tuple[str, ...] = ()) -> BackendLoad:
    return BackendLoad(name=name, model="m", healthy=True, running=running, free_blocks=100, total_blocks=100,
                       prefill_tokens_per_s=1000.0, adapters=frozenset(adapters))


BACKENDS = [load("idle", 0), load("busy-x", 10, ("x",)), load("busy-xy", 12, ("x", "y"))]


def test_an_adapter_goes_where_it_is_held_even_when_busier() -> None:
    decision = choose_backend(RouteRequest("m", [], 40, adapter="y"), BACKENDS)
    assert decision.chosen == "busy-xy"
    decision = choose_backend(RouteRequest("m", [], 40, adapter="x"), BACKENDS)
    assert decision.chosen == "busy-x" and {c.name for c in decision.candidates} == {"busy-x", "busy-xy"}


def test_the_base_model_goes_anywhere() -> None:
    assert choose_backend(RouteRequest("m", [], 40), BACKENDS).chosen == "idle"


def test_an_adapter_nobody_holds_is_model_not_found() -> None:
    decision = choose_backend(RouteRequest("m", [], 40, adapter="z"), BACKENDS)
    assert decision.chosen is None and decision.error is ErrorCode.MODEL_NOT_FOUND and "'z'" in decision.message


def test_the_load_report_carries_the_adapters() -> None:
    status = WorkerStatus(role=Role.PDFUSION, running=0, waiting=0, queued_prefill_tokens=0, step_latency_ms=1.0,
                          prefill_tokens_per_s=0.0, free_blocks=4, total_blocks=4, block_size=16, version=1,
                          iterate_count=0, alive=True, cache_version=0, adapters=("x", "y"))
    assert worker_status_from_pb(worker_status_to_pb(status)) == status
