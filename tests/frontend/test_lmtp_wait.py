"""LMTP streams wait for a model that is not ready (frontend/lmtp_wait.py): a MSG item says so, the stream
goes on once the backend answers, and ends with an error item naming the cause when LMTP_WAIT_S runs out."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import connect

from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, mock_frontend, script
from tests.support.procs import free_port_block


async def _frames(ws: Any, stream_id: int, on_msg: Any = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(MSG items, TOKEN items) of one stream until it ends."""
    msgs, tokens = [], []
    async with asyncio.timeout(30):
        while not tokens or not (tokens[-1].get("finish_reason") or "error" in tokens[-1]):
            kind, _, body = (await ws.recv()).partition(" ")
            items = [i for i in json.loads(body) if i.get("stream_id") == stream_id]
            if kind == "MSG":
                msgs += items
                if on_msg is not None:
                    on_msg()
            else:
                tokens += items
    return msgs, tokens


def test_a_stream_waits_for_its_model_and_says_so(tokenizer: TextTokenizer) -> None:
    grpc_port = free_port_block(6) + 1
    backend = MockBackendThread(script(tokenizer, "Hi there"), port=grpc_port)

    async def go(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with connect(url) as ws:
            await ws.send(json.dumps({"prompt": [1, 2], "stream_id": 7, "max_tokens": 8}).join(["GENERATE ", ""]))
            return await _frames(ws, 7, on_msg=backend.__enter__)   # the model "finishes loading" now

    try:
        with mock_frontend(tokenizer, f"127.0.0.1:{grpc_port}", LMTP_WAIT_S="20") as front:
            msgs, tokens = asyncio.run(go(front.url.replace("http", "ws") + "/lmtp"))
    finally:
        backend.__exit__()
    assert len(msgs) == 1 and "not ready" in msgs[0]["message"] and "waiting up to 20 s" in msgs[0]["message"]
    assert tokens[-1]["finish_reason"] and all("error" not in t for t in tokens)
    assert [t["token"] for t in tokens] == [*tokenizer.encode("Hi there"), 2]


def test_the_wait_ends_in_an_error_item(tokenizer: TextTokenizer) -> None:
    grpc_port = free_port_block(6) + 1

    async def go(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with connect(url) as ws:
            await ws.send('SCORE {"prompt": [1, 2], "scored": [3], "stream_id": 1}')
            return await _frames(ws, 1)

    with mock_frontend(tokenizer, f"127.0.0.1:{grpc_port}", LMTP_WAIT_S="1") as front:
        msgs, tokens = asyncio.run(go(front.url.replace("http", "ws") + "/lmtp"))
    assert "waiting up to 1 s" in msgs[0]["message"]
    assert len(tokens) == 1 and "unreachable" in tokens[0]["error"], tokens
