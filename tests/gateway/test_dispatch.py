"""The gateway's dispatcher, queue, breaker, prefix tree and config with hand-made upstream state: no servers."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, Lease, Ticket
from gateway.prefix import PrefixIndex, prefix_keys, request_text
from gateway.upstreams import CONNECTION, OK, SERVER_ERROR, UpstreamTable
from kvyard.errors import ErrorCode, RequestError
from kvyard.wait_queue import QueueFull, WaitQueue

A, B, C = "http://a:1", "http://b:1", "http://c:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(env: dict[str, str] | None = None, models: dict[str, list[str]] | None = None,
         clock: Clock | None = None) -> Dispatcher:
    models = models or {A: ["m"], B: ["m"]}
    cfg = GatewayConfig.from_env({"UPSTREAMS": ",".join(models), **(env or {})})
    table = UpstreamTable(cfg)
    for url, served in models.items():
        table.record_check(url, served, None)
    return Dispatcher(cfg, table, clock or Clock())


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(fn())


def ticket(text: str = "", model: str = "m", priority: int = 0, block: int = 64) -> Ticket:
    keys = prefix_keys(text, model, block, 1 << 20)
    return Ticket(model, tuple(keys), max(1, len(text)), priority)


# ---- least connection and MAX_CONNECT_PER_UPSTREAM ---------------------------------------------------

def test_least_connection_spreads_and_respects_the_per_upstream_limit() -> None:
    d = make({"GATEWAY_ROUTING": "least_connection", "MAX_CONNECT_PER_UPSTREAM": "2"}, {A: ["m"], B: ["m"], C: ["m"]})
    leases = [d.choose(Ticket("m")) for _ in range(6)]
    assert all(isinstance(lease, Lease) for lease in leases)
    assert sorted(lease.upstream for lease in leases) == [A, A, B, B, C, C]  # type: ignore[union-attr]
    assert d.choose(Ticket("m")) is None                 # every upstream is at 2
    d.release(leases[3])                                  # type: ignore[arg-type]
    again = d.choose(Ticket("m"))
    assert again is not None and again.upstream == leases[3].upstream  # type: ignore[union-attr]


def test_least_connection_picks_the_least_busy_not_the_first() -> None:
    d = make({"GATEWAY_ROUTING": "least_connection", "MAX_CONNECT_PER_UPSTREAM": "4"})
    first = d.choose(Ticket("m"))
    assert first is not None
    second = d.choose(Ticket("m"))
    assert second is not None and second.upstream != first.upstream


def test_unhealthy_and_foreign_upstreams_are_never_chosen() -> None:
    d = make({"MAX_CONNECT_PER_UPSTREAM": "8"}, {A: ["m"], B: ["m"], C: ["other"]})
    d.table.record_outcome(A, SERVER_ERROR, 100.0, "HTTP 500")
    chosen = {d.choose(Ticket("m")).upstream for _ in range(5)}  # type: ignore[union-attr]
    assert chosen == {B}


def test_a_4xx_is_not_a_failure_but_a_5xx_or_connection_error_is() -> None:
    d = make()
    d.table.record_outcome(A, OK, 100.0)
    assert d.table.upstreams[A].healthy and d.table.upstreams[A].breaker.failures == 0
    d.table.record_outcome(A, CONNECTION, 100.0, "refused")
    assert not d.table.upstreams[A].healthy and d.table.upstreams[A].breaker.failures == 1
    d.table.record_check(A, ["m"], None)                  # the next health check brings it back
    assert d.table.upstreams[A].routable(100.0)


# ---- the queue --------------------------------------------------------------------------------------

def test_all_busy_waits_and_is_dispatched_the_moment_one_frees() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1"})
        held = [await d.acquire(Ticket("m"), 1.0) for _ in range(2)]
        waiting = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done() and len(d.queue) == 1
        d.release(held[1])
        lease = await asyncio.wait_for(waiting, 1.0)
        assert lease.upstream == held[1].upstream and len(d.queue) == 0

    run(scenario)


def test_past_wait_for_is_overloaded_and_the_queue_is_left() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1"})
        for _ in range(2):
            await d.acquire(Ticket("m"), 1.0)
        with pytest.raises(RequestError) as err:
            await d.acquire(Ticket("m"), 0.05)
        assert err.value.code is ErrorCode.OVERLOADED and "WAIT_FOR" in err.value.message
        assert len(d.queue) == 0

    run(scenario)


def test_a_full_queue_refuses_at_once() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1", "GATEWAY_QUEUE_MAX": "1"})
        for _ in range(2):
            await d.acquire(Ticket("m"), 1.0)
        queued = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RequestError) as err:
            await d.acquire(Ticket("m"), 5.0)
        assert err.value.code is ErrorCode.OVERLOADED and loop.time() - start < 0.5
        queued.cancel()

    run(scenario)


def test_priority_then_arrival_order() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1"}, {A: ["m"]})
        held = await d.acquire(Ticket("m"), 1.0)
        order: list[str] = []

        async def client(name: str, priority: int) -> None:
            lease = await d.acquire(Ticket("m", priority=priority), 5.0)
            order.append(name)
            d.release(lease)

        tasks = []
        for name, priority in [("late-normal", 0), ("urgent", -5), ("low", 3), ("normal", 0)]:
            tasks.append(asyncio.ensure_future(client(name, priority)))
            await asyncio.sleep(0.005)
        d.release(held)
        await asyncio.wait_for(asyncio.gather(*tasks), 2.0)
        assert order == ["urgent", "late-normal", "normal", "low"]

    run(scenario)


def test_one_models_backlog_never_blocks_another_model() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1"}, {A: ["m"], B: ["n"]})
        await d.acquire(Ticket("m"), 1.0)
        stuck = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        other = await asyncio.wait_for(d.acquire(Ticket("n"), 5.0), 1.0)
        assert other.upstream == B and not stuck.done()
        stuck.cancel()

    run(scenario)


def test_a_new_request_never_jumps_the_queue() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1"}, {A: ["m"]})
        held = await d.acquire(Ticket("m"), 1.0)
        first = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        d.table.upstreams[A].in_flight -= 1      # room appears without a release (as after a health change)
        second = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()  # the newcomer queued behind the first
        d.table.upstreams[A].in_flight += 1
        d.release(held)
        assert (await asyncio.wait_for(first, 1.0)).upstream == A and not second.done()
        second.cancel()

    run(scenario)


def test_a_cancelled_waiter_leaves_the_queue_and_gives_back_a_racing_lease() -> None:
    async def scenario() -> None:
        d = make({"MAX_CONNECT_PER_UPSTREAM": "1"}, {A: ["m"]})
        held = await d.acquire(Ticket("m"), 1.0)
        waiting = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(d.queue) == 0
        # The race: room is found for a waiter in the same instant its client leaves.
        racing = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        d.release(held)   # assigns the lease to `racing` (its future is set) ...
        racing.cancel()   # ... before its task runs again
        await asyncio.gather(racing, return_exceptions=True)
        assert racing.cancelled()
        assert d.table.upstreams[A].in_flight == 0  # the lease went back

    run(scenario)


def test_health_recovery_pumps_the_queue() -> None:
    async def scenario() -> None:
        d = make({}, {A: ["m"]})
        d.table.record_outcome(A, CONNECTION, 100.0, "refused")
        waiting = asyncio.ensure_future(d.acquire(Ticket("m"), 5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        d.table.record_check(A, ["m"], None)
        d.pump()                                   # what the health loop does after each round
        assert (await asyncio.wait_for(waiting, 1.0)).upstream == A

    run(scenario)


def test_unknown_model_is_model_not_found() -> None:
    with pytest.raises(RequestError) as err:
        run(lambda: make().acquire(Ticket("nope"), 1.0))
    assert err.value.code is ErrorCode.MODEL_NOT_FOUND and "m" in err.value.message


def test_wait_queue_bound_and_order() -> None:
    async def scenario() -> None:
        q: WaitQueue[str, str] = WaitQueue(2, lambda _: None)
        q.push("b", 1)
        q.push("a", 0)
        with pytest.raises(QueueFull):
            q.push("c", -1)
        assert q.items() == ["a", "b"]
        assert q.pump(lambda item: item.upper() if item == "b" else None) == 1 and q.items() == ["a"]

    run(scenario)


# ---- prefix-aware routing ---------------------------------------------------------------------------

SHARED = "You are a meticulous assistant for the printing-press museum. " * 20


def test_prefix_routing_returns_a_shared_prefix_to_the_upstream_that_saw_it() -> None:
    d = make({"MAX_CONNECT_PER_UPSTREAM": "8"})
    first = d.choose(ticket(SHARED + "Who built it?"))
    assert first is not None and first.reason == "shortest_ttft"
    d.release(first)
    for question in ("When?", "Why did it matter?", "Where is it now?"):
        lease = d.choose(ticket(SHARED + question))
        assert lease is not None and lease.upstream == first.upstream and lease.reason == "prefix_hit"
        assert lease.hit_bytes >= len(SHARED) - 64
        d.release(lease)


def test_without_a_hit_prefix_routing_goes_to_the_least_loaded() -> None:
    d = make({"MAX_CONNECT_PER_UPSTREAM": "8"})
    busy = d.choose(ticket("x" * 4000))
    assert busy is not None
    other = d.choose(ticket("an unrelated question " * 10))
    assert other is not None and other.upstream != busy.upstream


def test_a_prompt_counts_as_queued_work_only_until_its_first_byte() -> None:
    clock = Clock()
    d = make({"MAX_CONNECT_PER_UPSTREAM": "8"}, clock=clock)
    cold = d.choose(ticket("unrelated " * 300))             # 3000 uncached bytes on X
    assert cold is not None
    x, y = cold.upstream, next(u for u in (A, B) if u != cold.upstream)
    for u in (x, y):
        d.table.upstreams[u].prefix.insert(list(ticket(SHARED).keys))  # both hold the prefix
    clock.now += 1
    waiting = d.choose(ticket(SHARED + "q1"))
    assert waiting is not None and waiting.upstream == y     # X's queue is the cold prompt
    d.release(waiting)
    d.started(cold)                                          # X computed it and is streaming now
    assert d.table.upstreams[x].in_flight_bytes == 0
    clock.now += 1
    lease = d.choose(ticket(SHARED + "q2"))
    assert lease is not None and lease.upstream == x and lease.reason == "prefix_hit"  # tied; X less recent


def test_imbalance_guard_overrides_the_cache() -> None:
    d = make({"MAX_CONNECT_PER_UPSTREAM": "64", "GATEWAY_IMBALANCE_ABS": "4"})
    d.table.upstreams[A].prefix.insert(list(ticket(SHARED).keys))  # only A has seen the long prefix
    held = []
    for i in range(6):
        lease = d.choose(ticket(SHARED + f"q{i}"))
        assert lease is not None
        held.append(lease)
    # The hit keeps them on A (cheap suffixes) until A runs 5 more than B: then the guard sends one to B.
    assert [(lease.upstream, lease.reason) for lease in held] == [(A, "prefix_hit")] * 5 + [(B, "imbalance")]


def test_request_text_is_stable_and_shares_prefixes_across_turns() -> None:
    base = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hi"}]
    longer = {"messages": [*base, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]}
    a, b = request_text({"messages": base}), request_text(longer)
    assert b.startswith(a)
    ka, kb = prefix_keys(a, "m", 16, 1 << 20), prefix_keys(b, "m", 16, 1 << 20)
    assert len(ka) > 5 and kb[:len(ka)] == ka
    assert prefix_keys(a, "other", 16, 1 << 20)[0] != ka[0]  # the model is part of the key
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert request_text(parts) == request_text({"messages": [{"role": "user", "content": "Hi"}]})
    assert request_text({"prompt": "abc"}) == "abc"


def test_prefix_index_forgets_the_least_recently_used() -> None:
    index = PrefixIndex(3)
    index.insert([1, 2, 3])
    index.insert([1])          # 1 is fresh again
    index.insert([4])
    assert set(index) == {1, 3, 4}


# ---- breaker ---------------------------------------------------------------------------------------

def test_breaker_opens_after_consecutive_failures_then_allows_one_trial() -> None:
    b = CircuitBreaker(threshold=3, open_s=10.0)
    for _ in range(2):
        b.record_failure(0.0)
    b.record_success()                    # not consecutive any more
    for _ in range(2):
        b.record_failure(1.0)
    assert b.state(1.0) == CLOSED
    b.record_failure(2.0)
    assert b.state(2.0) == OPEN and b.state(11.9) == OPEN and b.state(12.0) == HALF_OPEN
    b.record_failure(12.5)                # the trial failed: open again
    assert b.state(13.0) == OPEN
    b.record_success()
    assert b.state(13.0) == CLOSED


def test_an_open_breaker_keeps_traffic_away_even_when_health_checks_pass() -> None:
    clock = Clock()
    d = make({"GATEWAY_BREAKER_FAILURES": "2", "GATEWAY_BREAKER_OPEN_MS": "5000", "MAX_CONNECT_PER_UPSTREAM": "4"},
             clock=clock)
    for _ in range(2):
        d.table.record_outcome(A, SERVER_ERROR, clock.now, "HTTP 500")
    d.table.record_check(A, ["m"], None)
    assert {d.choose(Ticket("m")).upstream for _ in range(3)} == {B}  # type: ignore[union-attr]
    clock.now += 5.0                     # half-open: one trial request at a time
    trial = d.choose(Ticket("m"))
    assert trial is not None and trial.upstream == A
    assert d.choose(Ticket("m")).upstream == B  # type: ignore[union-attr]


# ---- config -----------------------------------------------------------------------------------------

def test_config_defaults_are_the_seeds() -> None:
    cfg = GatewayConfig.from_env({"UPSTREAMS": "http://llama-2:8000, http://falcon:8000/v1/"})
    assert cfg.upstreams == ("http://llama-2:8000", "http://falcon:8000")
    assert (cfg.max_connect_per_upstream, cfg.wait_for_s, cfg.timeout_s, cfg.debug, cfg.port) == (1, 5.0, 600.0,
                                                                                                  False, 8000)
    assert GatewayConfig.from_env({"UPSTREAMS": "http://x:1", "TIB_PORT": "8889", "DEBUG": "true"}).port == 8889
    assert GatewayConfig.from_env({"UPSTREAMS": "http://x:1", "START_PORT": "9001"}).port == 9001


@pytest.mark.parametrize(("env", "needle"), [
    ({}, "UPSTREAMS"),
    ({"UPSTREAMS": "llama:8000"}, "llama:8000"),
    ({"UPSTREAMS": "http://a:1,http://a:1"}, "twice"),
    ({"UPSTREAMS": "http://a:1", "MAX_CONNECT_PER_UPSTREAM": "0"}, "MAX_CONNECT_PER_UPSTREAM"),
    ({"UPSTREAMS": "http://a:1", "WAIT_FOR": "soon"}, "WAIT_FOR"),
    ({"UPSTREAMS": "http://a:1", "DEBUG": "maybe"}, "DEBUG"),
    ({"UPSTREAMS": "http://a:1", "GATEWAY_ROUTING": "random"}, "GATEWAY_ROUTING"),
])
def test_bad_config_names_the_setting(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        GatewayConfig.from_env(env)
