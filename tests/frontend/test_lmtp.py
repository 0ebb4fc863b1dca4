"""LMTP over WebSocket: framing, interleaved streams, SCORE, errors per stream, logit_bias and LMQL's own client.

The fast tests run the real frontend app in-process in front of a scripted backend; the slow ones talk
to the session's PDFUSION cluster on the embedded model and check the numbers (logprobs are real
log-softmax values, SCORE agrees with GENERATE and the backend's ScoreCall).
"""
from __future__ import annotations

import asyncio
import io
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

from backend.mock_backend import mock_logprob
from frontend.backend_client import BackendClient
from frontend.lmtp_client import LmtpConsole, parse_line
from kvyard.tokenizer import TextTokenizer
from tests.conftest import Cluster
from tests.support.procs import CLUSTER_TOKEN
from tests.support.stub_backend import StubFrontend, stub_frontend

LONG = 200  # max_tokens at or above this makes the stub stream LONG_STEPS steps (for cancellation; the
            # context is 256 tokens, so a prompt of one token leaves room for it)
LONG_STEPS = 400


@pytest.fixture(scope="module")
def script_ids(tokenizer: TextTokenizer) -> list[int]:
    return [*tokenizer.encode("Hello there, friend!"), 2]


@pytest.fixture(scope="module")
def stub(tokenizer: TextTokenizer, script_ids: list[int]) -> Iterator[StubFrontend]:
    def script(req: Any) -> list[int]:
        if req.stop.max_new_tokens >= LONG:
            return [script_ids[0]] * LONG_STEPS
        return script_ids
    with stub_frontend(tokenizer, script, delay_s=0.005) as frontend:
        yield frontend


async def send(ws: ClientConnection, command: str, payload: dict[str, Any] | str) -> None:
    await ws.send(f"{command} {payload if isinstance(payload, str) else json.dumps(payload)}")


async def collect(ws: ClientConnection, stream_ids: set[Any], timeout_s: float = 60.0
                  ) -> tuple[dict[Any, list[dict[str, Any]]], list[Any], list[dict[str, Any]]]:
    """Items per stream until each listed stream ended (finish_reason or error); also the arrival order
    of stream ids and every MSG item seen on the way."""
    items: dict[Any, list[dict[str, Any]]] = {s: [] for s in stream_ids}
    order: list[Any] = []
    msgs: list[dict[str, Any]] = []
    open_ = set(stream_ids)
    async with asyncio.timeout(timeout_s):
        while open_:
            kind, _, body = (await ws.recv()).partition(" ")
            batch = json.loads(body)
            assert isinstance(batch, list) and kind in ("TOKEN", "MSG")
            if kind == "MSG":
                msgs.extend(batch)
                continue
            for item in batch:
                sid = item["stream_id"]
                assert sid in open_, f"item after the end of stream {sid}: {item}"
                items[sid].append(item)
                order.append(sid)
                if item.get("error") is not None or item.get("finish_reason") is not None:
                    open_.discard(sid)
    return items, order, msgs


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- against the scripted backend -------------------------------------------------------------

def test_interleaved_streams_keep_their_order(stub: StubFrontend, script_ids: list[int]) -> None:
    async def go() -> tuple[dict[Any, list[dict[str, Any]]], list[Any]]:
        async with connect(stub.ws_url + "/lmtp") as ws:
            for sid in (1, 2, 3, 4):
                await send(ws, "GENERATE", {"model": "stub-model", "prompt": [1, 2, sid], "stream_id": sid,
                                            "max_tokens": 32, "top_logprobs": sid - 1})
            items, order, _ = await collect(ws, {1, 2, 3, 4})
            return items, order
    items, order = run(go())
    for sid, stream in items.items():
        assert [i["token"] for i in stream] == script_ids
        assert [i["finish_reason"] for i in stream] == [None] * (len(script_ids) - 1) + ["stop"]
        for item in stream:
            assert item["logprob"] == pytest.approx(mock_logprob(item["token"]))
            top = item["top_logprobs"]
            assert top[str(item["token"])] == item["logprob"]          # always the sampled token
            # the mock's alternatives: the next ids, each 1 below the one before (backend/mock_backend.py)
            assert top == {str(item["token"] + k): pytest.approx(item["logprob"] - k) for k in range(max(sid - 1, 1))}
    first_end = min(order.index(s) + len(items[s]) - 1 for s in items)
    assert len(set(order[:first_end])) > 1, f"streams did not interleave: {order}"


def test_score_sends_one_item_per_token(stub: StubFrontend) -> None:
    async def go() -> dict[Any, list[dict[str, Any]]]:
        async with connect(stub.ws_url + "/lmtp") as ws:
            await send(ws, "SCORE", {"model": "stub-model", "prompt": [5, 6], "scored": [7, 8, 9], "stream_id": 1})
            return (await collect(ws, {1}))[0]
    items = run(go())[1]
    assert [i["token"] for i in items] == [7, 8, 9]
    assert [i["logprob"] for i in items] == [pytest.approx(mock_logprob(t)) for t in (7, 8, 9)]
    assert [i["finish_reason"] for i in items] == [None, None, "stop"]
    assert all("top_logprobs" not in i for i in items)


def test_errors_stay_with_their_stream(stub: StubFrontend, script_ids: list[int]) -> None:
    async def go() -> tuple[dict[Any, list[dict[str, Any]]], list[dict[str, Any]], dict[Any, list[dict[str, Any]]]]:
        async with connect(stub.ws_url + "/lmtp") as ws:
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 1, "max_tokens": 4})  # fine, runs alongside
            await send(ws, "GENERATE", {"model": "nope", "prompt": [1], "stream_id": 2})
            await send(ws, "GENERATE", {"prompt": [1, 10**9], "stream_id": 3})
            await send(ws, "SCORE", {"prompt": [-4], "scored": [1], "stream_id": 4})
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 5, "max_tokens": 0})
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 6, "logit_bias": {"12": "a lot"}})
            await send(ws, "GENERATE", {"prompt": [], "stream_id": 7})
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 10, "seed": 2**70})  # past int64: was INTERNAL
            await send(ws, "SCORE", {"prompt": [2**40], "scored": [1], "stream_id": 11})  # past int32
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 12, "repetition_penalty": 1e-40})
            await send(ws, "GENERATE", {"prompt": [1] * 250, "stream_id": 13, "max_tokens": 10})  # past 256
            await send(ws, "GENERATE", "{not json")
            await send(ws, "DANCE", {"stream_id": 8})
            items, _, msgs = await collect(ws, {1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13})
            await send(ws, "GENERATE", {"prompt": [3], "stream_id": 9})  # the connection goes on
            after, _, _ = await collect(ws, {9})
            return items, msgs, after
    items, msgs, after = run(go())
    assert [i["token"] for i in items[1]] == script_ids[:4] and items[1][-1]["finish_reason"] == "length"
    for sid, needle in [(2, "model_not_found"), (3, "vocabulary"), (4, "vocabulary"), (5, "max_tokens"),
                        (6, "logit_bias"), (7, "prompt"), (10, "invalid_argument"), (11, "invalid_argument"),
                        (12, "repetition_penalty"), (13, "context_length_exceeded: This model's maximum context")]:
        assert len(items[sid]) == 1 and set(items[sid][0]) == {"stream_id", "error"}, items[sid]
        assert needle in items[sid][0]["error"]
    assert {m["stream_id"] for m in msgs} == {None, 8} and all("error" in m for m in msgs)
    assert [i["token"] for i in after[9]] == script_ids


def test_duplicate_running_stream_id_is_refused(stub: StubFrontend) -> None:
    async def go() -> list[dict[str, Any]]:
        async with connect(stub.ws_url + "/lmtp") as ws:
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 1, "max_tokens": LONG})
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 1})
            async with asyncio.timeout(30):
                while True:
                    kind, _, body = (await ws.recv()).partition(" ")
                    errors = [i for i in json.loads(body) if "error" in i]
                    if errors:
                        return errors
    errors = run(go())
    assert errors[0]["stream_id"] == 1 and "still running" in errors[0]["error"]


def test_model_info_and_closing_the_socket_cancels_streams(stub: StubFrontend) -> None:
    async def go() -> list[dict[str, Any]]:
        async with connect(stub.ws_url) as ws:  # "/" too, where LMQL connects
            await send(ws, "MODEL_INFO", {"model": "stub-model", "stream_id": 1})
            await send(ws, "MODEL_INFO", {"model": "other", "stream_id": 2})
            await send(ws, "MODEL_INFO", {"model": "auto", "stream_id": 4})
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 3, "max_tokens": LONG})
            msgs: list[dict[str, Any]] = []
            tokens = 0
            async with asyncio.timeout(30):
                while len(msgs) < 3 or tokens < 3:
                    kind, _, body = (await ws.recv()).partition(" ")
                    if kind == "MSG":
                        msgs.extend(json.loads(body))
                    else:
                        tokens += len(json.loads(body))
            return msgs
    msgs = {m["stream_id"]: m for m in run(go())}
    info = msgs[1]["model_info"]
    assert info["model"] == "stub-model" and info["max_seq_len"] == 256 and info["vocab_size"] > 0
    assert "model_not_found" in msgs[2]["error"] and "stub-model" in msgs[2]["error"]  # names what is served
    assert msgs[4]["model_info"]["model"] == "stub-model"  # "auto": this endpoint's model
    # Every long stream of this module ends only by being cancelled, this one's by the closed socket. (Short
    # streams of other tests may be cancelled too when a slow machine lets their socket close first.)
    long_ids = {r.request_id for r in stub.engine.generation_requests if r.stop.max_new_tokens >= LONG}
    for _ in range(100):
        if long_ids <= set(stub.engine.cancelled_ids):
            break
        time.sleep(0.05)
    assert long_ids <= set(stub.engine.cancelled_ids), (long_ids, stub.engine.cancelled_ids)


def test_parse_line_takes_options_from_the_end() -> None:
    assert parse_line("Hello there max_tokens=5 temperature=1.2") == ("Hello there",
                                                                       {"max_tokens": 5, "temperature": 1.2})
    assert parse_line("x=1 is text here top_k=3") == ("x=1 is text here", {"top_k": 3})


def test_lmql_client_against_the_stub(stub: StubFrontend, script_ids: list[int]) -> None:
    lmtp_client = pytest.importorskip("lmql.models.lmtp.lmtp_client")
    errors = pytest.importorskip("lmql.models.lmtp.errors")
    import aiohttp

    async def go() -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
        async with aiohttp.ClientSession() as session, session.ws_connect(stub.url) as ws:
            client = lmtp_client.LMTPWebSocketClient("stub-model", ws)
            client.connect()
            info = await client.request("MODEL_INFO", {})
            generated = [t async for t in client.generate([1, 2, 3], max_tokens=8, temperature=0.0,
                                                          logit_bias=None, top_logprobs=2)]
            scored = [t async for t in client.score([1, 2, 3], [4, 5])]
            with pytest.raises(errors.LMTPStreamError, match="vocabulary"):
                _ = [t async for t in client.generate([10**9], max_tokens=2)]
            client.handler.cancel()
            return info, generated, scored
    info, generated, scored = run(go())
    assert info["model_info"]["model"] == "stub-model"
    assert [t["token"] for t in generated] == script_ids
    assert [t["token"] for t in scored] == [4, 5] and scored[-1]["finish_reason"] == "stop"


# ---- against the real model -------------------------------------------------------------------

def _ws(cluster: Cluster, path: str = "/lmtp") -> str:
    return "ws" + cluster.base_url[len("http"):] + path


async def _generate(ws: ClientConnection, stream_id: int, prompt: list[int], **options: Any) -> list[dict[str, Any]]:
    await send(ws, "GENERATE", {"prompt": prompt, "stream_id": stream_id, **options})
    return (await collect(ws, {stream_id}))[0][stream_id]


@pytest.mark.slow
def test_real_interleaved_streams_match_each_alone(pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")]

    async def go() -> tuple[list[list[dict[str, Any]]], dict[Any, list[dict[str, Any]]]]:
        async with connect(_ws(pdfusion)) as ws:
            alone = [await _generate(ws, i, p, max_tokens=8) for i, p in enumerate(prompts)]
            for i, p in enumerate(prompts):
                await send(ws, "GENERATE", {"prompt": p, "stream_id": 10 + i, "max_tokens": 8})
            together, _, _ = await collect(ws, {10, 11, 12})
            return alone, together
    alone, together = run(go())
    for i, stream in enumerate(alone):
        assert [t["token"] for t in together[10 + i]] == [t["token"] for t in stream]
        assert [t["logprob"] for t in together[10 + i]] == pytest.approx([t["logprob"] for t in stream], abs=1e-3)
        assert [t["finish_reason"] is not None for t in stream].count(True) == 1
        assert stream[-1]["finish_reason"] in ("stop", "length")
    assert "Paris" in tokenizer.decode([t["token"] for t in alone[0]])


SCORE_VS_DECODE = 0.02


@pytest.mark.slow
def test_real_score_matches_generate_and_score_call(pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    prompt = tokenizer.encode("The quick brown fox jumps over the")

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[float]]:
        async with connect(_ws(pdfusion)) as ws:
            generated = await _generate(ws, 1, prompt, max_tokens=6, top_logprobs=5)
            tokens = [t["token"] for t in generated]
            await send(ws, "SCORE", {"prompt": prompt, "scored": tokens, "stream_id": 2})
            scored = (await collect(ws, {2}))[0][2]
        backend = BackendClient(pdfusion.grpc_address, CLUSTER_TOKEN)
        direct = await backend.score("test-score", prompt, tokens)
        await backend.close()
        return generated, scored, [lp.logprob for lp in direct.logprobs]
    generated, scored, direct = run(go())
    assert [t["token"] for t in scored] == [t["token"] for t in generated]
    assert [t["logprob"] for t in scored] == pytest.approx(direct, abs=1e-6)
    # Scoring prefills the answer in one chunk, generation decoded it a row at a time: in the CPU serving
    # format (float16 KV cache, int16 activations) the two round differently. Measured on 384 positions
    # of ordinary text, 2026-11-24: median 3.7e-4, p99 2.3e-3, max 8.4e-3 (float32 everything: 1.3e-5).
    assert [t["logprob"] for t in scored] == pytest.approx([t["logprob"] for t in generated], abs=SCORE_VS_DECODE)
    assert [t["finish_reason"] for t in scored] == [None] * 5 + ["stop"]
    for item in generated:  # greedy: the sampled token is the most likely one, and a real log-probability
        assert item["logprob"] == pytest.approx(max(item["top_logprobs"].values()))
        assert item["logprob"] <= 0 and sum(math.exp(v) for v in item["top_logprobs"].values()) <= 1 + 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("bias", [100.0, 3.0])
def test_real_logit_bias_gives_log_softmax_under_the_bias(pdfusion: Cluster, tokenizer: TextTokenizer,
                                                          bias: float) -> None:
    prompt = tokenizer.encode("My favourite colour is")

    async def go() -> tuple[dict[str, Any], dict[str, Any], int]:
        async with connect(_ws(pdfusion)) as ws:
            plain = (await _generate(ws, 1, prompt, max_tokens=1, top_logprobs=20))[0]
            ranked = sorted(plain["top_logprobs"].items(), key=lambda kv: -kv[1])
            target = int(ranked[12 if bias > 50 else 1][0])   # a token greedy decoding would not pick
            biased = (await _generate(ws, 2, prompt, max_tokens=1, top_logprobs=5,
                                      logit_bias={str(target): bias}))[0]
            return plain, biased, target
    plain, biased, target = run(go())
    assert target != plain["token"]
    if bias > 50:
        assert biased["token"] == target
    lp_target = plain["top_logprobs"][str(target)]
    # log-softmax after adding `bias` to one logit: log Z' = log(p_t e^bias + (1 - p_t))
    log_z = float(np.logaddexp(lp_target + bias, math.log1p(-math.exp(lp_target))))
    expected = {int(t): v - log_z for t, v in plain["top_logprobs"].items()}
    expected[target] += bias
    assert biased["logprob"] == pytest.approx(expected[biased["token"]], abs=2e-3)
    checked = [t for t in map(int, biased["top_logprobs"]) if t in expected]
    assert target in checked and len(checked) >= 3
    for token in checked:
        assert biased["top_logprobs"][str(token)] == pytest.approx(expected[token], abs=2e-3)


@pytest.mark.slow
def test_real_lmql_client(pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    lmtp_client = pytest.importorskip("lmql.models.lmtp.lmtp_client")
    import aiohttp
    prompt = tokenizer.encode("The capital of France is")

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with aiohttp.ClientSession() as session, session.ws_connect(pdfusion.base_url) as ws:
            client = lmtp_client.LMTPWebSocketClient("SmolLM2-135M-Instruct", ws)
            client.connect()
            generated = [t async for t in client.generate(prompt, max_tokens=5, temperature=0.0,
                                                          logit_bias=None, top_logprobs=1)]
            scored = [t async for t in client.score(prompt, [t["token"] for t in generated])]
            client.handler.cancel()
            return generated, scored
    generated, scored = run(go())
    assert len(generated) == 5 and generated[-1]["finish_reason"] == "length"
    assert "Paris" in tokenizer.decode([t["token"] for t in generated])
    # Scoring prefills the answer in one chunk, generation decoded it a row at a time: in the CPU serving
    # format (float16 KV cache, int16 activations) the two round differently. Measured on 384 positions
    # of ordinary text, 2026-11-24: median 3.7e-4, p99 2.3e-3, max 8.4e-3 (float32 everything: 1.3e-5).
    assert [t["logprob"] for t in scored] == pytest.approx([t["logprob"] for t in generated], abs=SCORE_VS_DECODE)


@pytest.mark.slow
def test_real_interactive_client(pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    out = io.StringIO()

    async def go() -> str:
        async with connect(_ws(pdfusion)) as ws:
            return await LmtpConsole(ws, tokenizer, "", out).run_prompt("Hello there max_tokens=5 temperature=0")
    text = run(go())
    lines = out.getvalue().splitlines()
    assert sum(line.startswith(">>>> {") for line in lines) == 5
    assert text.startswith("Hello there") and len(text) > len("Hello there")


def test_each_stream_counts_against_the_concurrency_limit(tokenizer: TextTokenizer, script_ids: list[int]) -> None:
    """One WebSocket used to run any number of streams under CONCURRENCY_LIMIT=2: now every GENERATE or
    SCORE stream takes a slot of its own, and the slot comes back when the stream ends."""
    def script(req: Any) -> list[int]:
        return [script_ids[0]] * 60 if req.stop.max_new_tokens >= LONG else script_ids

    async def go(url: str) -> tuple[dict[Any, list[dict[str, Any]]], dict[Any, list[dict[str, Any]]]]:
        async with connect(url + "/lmtp") as ws:
            for sid in (1, 2, 3):
                await send(ws, "GENERATE", {"prompt": [1], "stream_id": sid, "max_tokens": LONG})
            first, _, _ = await collect(ws, {1, 2, 3})
            await send(ws, "GENERATE", {"prompt": [1], "stream_id": 4, "max_tokens": 8})
            later, _, _ = await collect(ws, {4})
            return first, later

    with stub_frontend(tokenizer, script, delay_s=0.01, CONCURRENCY_LIMIT="2") as frontend:
        first, later = run(go(frontend.ws_url))
        deadline = time.monotonic() + 3
        while frontend.app.state.admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)  # a stream's slot is freed just after its last item went out
        assert frontend.app.state.admission.in_flight == 0
    assert [len(first[s]) for s in (1, 2)] == [60, 60] and first[1][-1]["finish_reason"] is not None
    assert len(first[3]) == 1 and "CONCURRENCY_LIMIT" in str(first[3][0]["error"])
    assert [i["token"] for i in later[4]] == script_ids
