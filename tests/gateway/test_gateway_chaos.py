"""Chaos: an upstream dies under load behind the gateway (health checks too rare to notice: the proxied
requests must). Every request is counted: answered (200, the whole
body) or errored (an error status, or a stream cut short, which the client can tell from the missing
[DONE]); none hangs, and once the gateway has seen the death every request goes to the live upstream."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.gateway.test_proxy import gateway, view, wait_until
from tests.support.fake_upstream import sse_reply

EVENTS = [{"choices": [{"delta": {"content": f"w{i}"}}]} for i in range(6)]
REQUESTS = 24
BOUND_S = 20.0  # every request ends within this (loose: a loaded 2-core CI machine)


def one(url: str, i: int) -> str:
    """'answered' or 'errored' (raises when the request hung past BOUND_S)."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": f"q{i}"}]}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=BOUND_S) as resp:
            text = b"".join(resp.iter_bytes())
    except httpx.TimeoutException:
        raise AssertionError(f"request {i} hung") from None
    except httpx.TransportError:
        return "errored"  # the connection was cut mid-stream: the client knows it failed
    if resp.status_code != 200:
        assert b'"error"' in text, (resp.status_code, text)  # an error object, not a bare status
        return "errored"
    return "answered" if text.endswith(b"data: [DONE]\n\n") else "errored"


def test_a_dying_upstream_under_load_loses_no_request() -> None:
    from tests.support.fake_upstream import fake_upstreams

    with fake_upstreams(["m"], ["m"]) as (dying, steady):
        for f in (dying, steady):
            f.reply = sse_reply(EVENTS, pause_s=0.05)
        with gateway([dying, steady], GATEWAY_ROUTING="least_connection", MAX_CONNECT_PER_UPSTREAM="4",
                     GATEWAY_HEALTH_INTERVAL_MS="60000", GATEWAY_BREAKER_FAILURES="2") as client:
            url = str(client.base_url).rstrip("/")
            wait_until(lambda: all(u["healthy"] for u in view(client).values()), 5.0)
            started = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(one, url, i) for i in range(REQUESTS)]
                wait_until(lambda: len(dying.received) >= 4, 10.0)  # it is serving some of them
                dying.die()
                outcomes = [f.result(timeout=BOUND_S + 5) for f in futures]
            assert time.monotonic() - started < BOUND_S + 5
            assert len(outcomes) == REQUESTS  # every request accounted for
            assert outcomes.count("answered") >= REQUESTS - 4, outcomes  # at most those in flight on it failed
            v = view(client)[dying.url]  # no health check ran since: the requests themselves found it dead
            assert not v["healthy"] and v["failures"].get("connection", 0) >= 1, v
            after = [one(url, 1000 + i) for i in range(6)]  # the gateway knows: all go to the live one
            assert after == ["answered"] * 6
