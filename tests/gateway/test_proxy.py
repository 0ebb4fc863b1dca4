"""The gateway app in process, in front of scripted upstreams (tests/support/fake_upstream.py): bytes both
ways, discovery, retry before the first byte, 4xx untouched, the queue's 429 and the 504, disconnects."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from tests.support.app_thread import AppThread
from tests.support.fake_upstream import FakeUpstream, Reply, fake_upstreams, sse_reply
from tests.support.openai_errors import assert_error


@contextmanager
def gateway(fakes: list[FakeUpstream], **env: str) -> Iterator[httpx.Client]:
    cfg = GatewayConfig.from_env({"UPSTREAMS": ",".join(f.url for f in fakes), "HOST": "127.0.0.1", **env})
    with AppThread(create_gateway_app(cfg)) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


def view(client: httpx.Client) -> dict[str, Any]:
    return {u["url"]: u for u in client.get("/upstreams").json()["upstreams"]}


def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


# ---- bytes both ways --------------------------------------------------------------------------------

ODD_BODY = b'{ "model" : "m",\n  "messages":[{"role":"user","content":"h\\u00e9"}], "x-extra": [1,2.50] }'


def test_request_and_streamed_response_pass_byte_for_byte_with_no_chunk_held_back() -> None:
    with fake_upstreams(["m"]) as (up,):
        # Chunk boundaries that split an SSE event and a UTF-8 character, and a pause after the first.
        up.reply = Reply(chunks=(b'data: {"a": "\xc3', b'\xa9"}\n\ndata: {"b"', b': 2}\n\n', b"data: [DONE]\n\n"),
                         pause_s=0.4, headers=(("content-type", "text/event-stream"), ("x-upstream-note", "one"),
                                               ("set-cookie", "a=1"), ("set-cookie", "b=2")))
        with gateway([up]) as client:
            start = time.monotonic()
            arrivals: list[tuple[float, bytes]] = []
            with client.stream("POST", "/v1/chat/completions", content=ODD_BODY,
                               headers={"authorization": "Bearer upstream-key", "x-custom": "kept"}) as resp:
                assert resp.status_code == 200
                assert resp.headers["x-upstream-note"] == "one"
                assert resp.headers.get_list("set-cookie") == ["a=1", "b=2"]
                for chunk in resp.iter_raw():
                    arrivals.append((time.monotonic() - start, chunk))
            body = b"".join(c for _, c in arrivals)
            assert body == b"".join(up.reply.chunks)
            assert arrivals[0][0] < 0.3, arrivals  # the first chunk came before the upstream's pause ended
            sent = up.received[-1]
            assert sent.body == ODD_BODY and sent.path == "/v1/chat/completions"
            headers = dict(sent.headers)
            assert headers[b"authorization"] == b"Bearer upstream-key" and headers[b"x-custom"] == b"kept"


def test_non_streamed_response_and_its_status_pass_through() -> None:
    with fake_upstreams(["m"]) as (up,):
        up.reply = Reply(status=201, chunks=(b'{"id":"x",', b'"object":"chat.completion"}'))
        with gateway([up]) as client:
            resp = client.post("/v1/completions", content=b'{"model":"m","prompt":"hi"}')
            assert resp.status_code == 201 and resp.content == b'{"id":"x","object":"chat.completion"}'
            assert up.received[-1].path == "/v1/completions"


# ---- discovery ---------------------------------------------------------------------------------------

def test_models_are_the_union_and_an_unknown_model_is_404() -> None:
    with fake_upstreams(["a"], ["a", "b"]) as fakes:
        with gateway(fakes) as client:
            data = client.get("/v1/models").json()["data"]
            assert {m["id"]: m["healthy_upstreams"] for m in data} == {"a": 2, "b": 1}
            err = assert_error(client.post("/v1/chat/completions", json={"model": "c", "messages": []}), 404,
                               "model_not_found")
            assert "a, b" in err["message"] and err["param"] == "model"
            assert not any(f.received for f in fakes)


def test_the_dashboard_page_shows_the_upstreams_view() -> None:
    with fake_upstreams(["a"]) as fakes:
        with gateway(fakes) as client:
            page = client.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert 'fetch("/upstreams"' in page.text and "<script" in page.text and "https://" not in page.text
            view = client.get("/upstreams").json()   # the fields the page reads
            assert {"url", "models", "healthy", "breaker", "in_flight", "peak_in_flight", "served", "failures",
                    "prefix_blocks"} <= set(view["upstreams"][0]) and "queued" in view


def test_requests_route_by_model() -> None:
    with fake_upstreams(["a"], ["b"]) as (ua, ub):
        with gateway([ua, ub]) as client:
            for _ in range(3):
                assert client.post("/v1/chat/completions", json={"model": "b", "messages": []}).status_code == 200
            assert len(ub.received) == 3 and not ua.received


BAD_BODIES = [b"{not json", b"[1]", b'{"model": 5}', b'{"model": "m", "priority": "high"}', b'{"model": ""}',
              b"{}"]  # no model, and two models to choose from


def test_bad_input_is_a_400_error_object_and_reaches_no_upstream() -> None:
    with fake_upstreams(["m"], ["n"]) as fakes:
        with gateway(fakes) as client:
            for body in BAD_BODIES:
                assert_error(client.post("/v1/chat/completions", content=body), 400, "invalid_argument")
            err = assert_error(client.post("/v1/chat/completions", content=b'{"model": "m"}',
                                           headers={"x-priority": "soon"}), 400, "invalid_argument")
            assert "X-Priority" in err["message"]
            assert not any(f.received for f in fakes)


def test_a_cross_site_post_is_refused_as_the_frontend_refuses_it() -> None:
    """A page on another site (a form post or text/plain fetch, no preflight) reaches no upstream;
    CORS_ALLOW_ORIGINS opens the gateway to the origins it names, as on the frontend."""
    chat = {"model": "m", "messages": []}
    with fake_upstreams(["m"]) as (up,):
        with gateway([up]) as client:
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/json"):
                resp = client.post("/v1/chat/completions", content=json.dumps(chat),
                                   headers={"content-type": ctype, "origin": "https://evil.example"})
                assert_error(resp, 403, "origin_not_allowed")
                assert "access-control-allow-origin" not in resp.headers
            assert not up.received
            assert client.get("/v1/models", headers={"origin": "https://evil.example"}).status_code == 200
            assert client.post("/v1/chat/completions", json=chat).status_code == 200  # curl, the SDKs: no Origin
        with gateway([up], CORS_ALLOW_ORIGINS="https://app.example") as client:
            pre = client.options("/v1/chat/completions", headers={
                "origin": "https://app.example", "access-control-request-method": "POST",
                "access-control-request-headers": "content-type"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
            ok = client.post("/v1/chat/completions", json=chat, headers={"origin": "https://app.example"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
            assert_error(client.post("/v1/chat/completions", json=chat, headers={"origin": "https://evil.example"}),
                         403, "origin_not_allowed")
            assert len(up.received) == 2


# ---- failures ----------------------------------------------------------------------------------------

def test_a_5xx_before_any_byte_is_retried_once_elsewhere_and_marks_the_upstream_unhealthy() -> None:
    with fake_upstreams(["m"], ["m"]) as (bad, good):
        bad.reply = Reply(status=500, chunks=(b'{"error":"boom"}',))
        good.reply = Reply(chunks=(b'{"fine":1}',))
        with gateway([bad, good], GATEWAY_ROUTING="least_connection") as client:
            for _ in range(3):
                resp = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
                assert resp.status_code == 200 and resp.content == b'{"fine":1}'
            assert len(bad.received) == 1  # unhealthy at once: no more traffic until a health check passes
            v = view(client)
            assert not v[bad.url]["healthy"] and v[bad.url]["failures"] == {"5xx": 1}
            assert v[good.url]["healthy"] and v[good.url]["failures"] == {}
            metrics = client.get("/metrics").text
            assert f'kvyard:gateway_upstream_errors_total{{kind="5xx",model_name="m",upstream="{bad.url}"}} 1.0' in metrics
            assert f'kvyard:gateway_upstream_responses_total{{model_name="m",status="200",upstream="{good.url}"}} 3.0' \
                in metrics


def test_a_5xx_with_nowhere_else_to_go_is_passed_through() -> None:
    with fake_upstreams(["m"]) as (bad,):
        bad.reply = Reply(status=503, chunks=(b'{"error":{"message":"warming up"}}',))
        with gateway([bad]) as client:
            resp = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
            assert resp.status_code == 503 and resp.content == b'{"error":{"message":"warming up"}}'


def test_a_4xx_is_passed_through_untouched_and_is_no_failure() -> None:
    body = b'{"error":{"message":"temperature: must be <= 2","type":"invalid_request_error","code":"x"}}'
    with fake_upstreams(["m"], ["m"]) as (first, second):
        for f in (first, second):
            f.reply = Reply(status=400, chunks=(body,))
        with gateway([first, second]) as client:
            for _ in range(6):
                resp = client.post("/v1/chat/completions", json={"model": "m", "temperature": 9})
                assert resp.status_code == 400 and resp.content == body
            assert len(first.received) + len(second.received) == 6  # never retried
            for u in view(client).values():
                assert u["healthy"] and u["failures"] == {} and u["consecutive_failures"] == 0
                assert u["breaker"] == "closed"


def test_an_unreachable_upstream_is_retried_elsewhere() -> None:
    with fake_upstreams(["m"], ["m"]) as (doomed, good):
        with gateway([doomed, good], GATEWAY_ROUTING="least_connection") as client:
            doomed.stop()  # its port refuses connections from now on; the gateway has not noticed yet
            for _ in range(4):
                resp = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
                assert resp.status_code == 200, resp.text
            v = view(client)
            assert v[doomed.url]["failures"] == {"connection": 1} and not v[doomed.url]["healthy"]
            assert len(good.received) == 4


def test_past_timeout_before_the_first_byte_is_504() -> None:
    with fake_upstreams(["m"]) as (slow,):
        slow.reply = Reply(first_pause_s=1.5)
        with gateway([slow], TIMEOUT="300") as client:
            start = time.monotonic()
            err = assert_error(client.post("/v1/chat/completions", json={"model": "m"}), 504, "timeout")
            assert time.monotonic() - start < 1.2 and "TIMEOUT" in err["message"]
            wait_until(lambda: view(client)[slow.url]["in_flight"] == 0)


# ---- the queue ---------------------------------------------------------------------------------------

def chat_url(client: httpx.Client) -> str:
    return f"{str(client.base_url).rstrip('/')}/v1/chat/completions"


def post_in_thread(url: str, body: dict[str, Any], results: list[Any], **kw: Any) -> threading.Thread:
    def run() -> None:
        try:
            results.append(httpx.post(url, json=body, timeout=20, **kw))
        except httpx.HTTPError as exc:
            results.append(exc)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_all_busy_queues_instead_of_429_then_429_past_wait_for() -> None:
    with fake_upstreams(["m"]) as (up,):
        up.reply = Reply(chunks=(b"{", b"}"), pause_s=0.5)
        with gateway([up], MAX_CONNECT_PER_UPSTREAM="1", WAIT_FOR="1500") as client:
            results: list[Any] = []
            threads = [post_in_thread(chat_url(client), {"model": "m"}, results) for _ in range(2)]
            for t in threads:
                t.join()
            assert [r.status_code for r in results] == [200, 200]  # the second waited ~0.5 s, no 429
            assert view(client)[up.url]["peak_in_flight"] == 1
            # Three at once: the third would wait ~1 s for the second's slot... past a 700 ms WAIT_FOR.
        with gateway([up], MAX_CONNECT_PER_UPSTREAM="1", WAIT_FOR="700") as client:
            results = []
            threads = []
            for _ in range(3):
                threads.append(post_in_thread(chat_url(client), {"model": "m"}, results))
                time.sleep(0.05)
            for t in threads:
                t.join()
            statuses = sorted(r.status_code for r in results)
            assert statuses == [200, 200, 429], statuses
            refused = next(r for r in results if r.status_code == 429)
            assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"


def test_a_client_that_leaves_the_queue_never_reaches_an_upstream() -> None:
    with fake_upstreams(["m"]) as (up,):
        up.reply = Reply(chunks=(b"{", b"}"), pause_s=1.0)
        with gateway([up], MAX_CONNECT_PER_UPSTREAM="1", WAIT_FOR="10000") as client:
            results: list[Any] = []
            busy = post_in_thread(chat_url(client), {"model": "m", "n": 1}, results)
            wait_until(lambda: len(up.received) == 1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(chat_url(client), json={"model": "m", "n": 2}, timeout=0.3)  # gives up while queued
            wait_until(lambda: client.get("/upstreams").json()["queued"] == 0, 2.0)
            busy.join()
            time.sleep(0.2)
            assert [json.loads(r.body)["n"] for r in up.received] == [1]


def test_a_client_that_leaves_mid_stream_closes_the_upstream_request() -> None:
    with fake_upstreams(["m"]) as (up,):
        up.reply = sse_reply([{"i": i} for i in range(50)], pause_s=0.1)
        with gateway([up]) as client:
            with client.stream("POST", "/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
                chunks = resp.iter_raw()
                next(chunks)
                next(chunks)
            wait_until(lambda: up.closed_early == 1, 3.0)   # long before its 5 s script would end
            wait_until(lambda: view(client)[up.url]["in_flight"] == 0, 2.0)
            assert view(client)[up.url]["failures"] == {}     # the client's leaving is no upstream failure


def test_a_killed_upstreams_traffic_moves_and_health_checks_bring_it_back() -> None:
    with fake_upstreams(["m"], ["m"]) as (flaky, steady):
        with gateway([flaky, steady], GATEWAY_HEALTH_INTERVAL_MS="200",
                     GATEWAY_ROUTING="least_connection") as client:
            flaky.models_status = 503                     # the seed: all its models unavailable
            wait_until(lambda: not view(client)[flaky.url]["healthy"], 2.0)
            before = len(flaky.received)
            for _ in range(4):
                assert client.post("/v1/chat/completions", json={"model": "m"}).status_code == 200
            assert len(flaky.received) == before
            flaky.models_status = 200
            wait_until(lambda: view(client)[flaky.url]["healthy"], 2.0)
            for _ in range(4):
                assert client.post("/v1/chat/completions", json={"model": "m"}).status_code == 200
            assert len(flaky.received) > before
