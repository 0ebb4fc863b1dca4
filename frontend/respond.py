"""The last stage of every HTTP dialect: its wire events out as Server-Sent Events (headers, framing, the
error tail) or as one JSON body, cancelled when the client goes away; and RTP-LLM's aux_info, which the
chat and `POST /` bodies share.

A stream that fails after its 200 and headers are gone cannot change its status any more: the error
travels as the dialect's own error event (frontend/errors.py's stream_error_body), then its end marker.
Starlette cancels a StreamingResponse whose client disconnects; a plain handler it would let run to the
end, so respond() cancels that work itself (kvyard/disconnect.py, which the master and gateway use too),
which closes the backend call and so aborts the request there and frees its KV."""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from frontend.backend_client import BackendOutput
from frontend.errors import stream_error_body
from kvyard.aux_info import AuxInfo
from kvyard.disconnect import cancel_on_disconnect

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what SSE itself treats as the end of a line


def sse_message(text: str, event: str = "message") -> str:
    """One named SSE event; every line of `text` its own `data:` line, so a reader joins them back with \\n."""
    return f"event: {event}\n" + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(text)) + "\n"


@dataclass(frozen=True)
class SseFraming:
    """How a dialect frames its events on the wire."""
    event: Callable[[str], str]   # one event carrying this text (a JSON body, or /generate's plain text)
    error: Callable[[str], str]   # the error event carrying this JSON error object
    end: str                      # sent last, after the events or after the error


def _data(text: str) -> str:
    return f"data: {text}\n\n"


OPENAI_SSE = SseFraming(_data, _data, "data: [DONE]\n\n")
RTP_SSE = SseFraming(lambda text: f"data:{text}\n\n", lambda text: f"data:{text}\n\n", "data:[done]\n\n")
# /v1/responses: each event names its type itself (`event: response.output_text.delta`); no end marker.
RESPONSES_SSE = SseFraming(lambda text: f"{text}\n\n", lambda text: f"event: error\ndata: {text}\n\n", "")
EVENT_SSE = SseFraming(sse_message, lambda text: sse_message(text, "error"), "event: end\n\n")  # POST /generate


def sse_response(events: AsyncIterator[str], framing: SseFraming) -> StreamingResponse:
    return StreamingResponse(_framed(events, framing), media_type="text/event-stream", headers=SSE_HEADERS)


async def respond(request: Request, stream: bool, events: Callable[[], AsyncIterator[str]],
                  whole: Callable[[], Awaitable[dict[str, Any]]], framing: SseFraming = OPENAI_SSE) -> Response:
    """The dispatch every JSON dialect shares: SSE when the client streams, else the whole body."""
    if stream:
        return sse_response(events(), framing)
    return JSONResponse(await cancel_on_disconnect(request, whole()))


async def first_come(request: Request, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """The events, once the first of them has come (the backend's first token). A stream's 200 goes out
    only then, so what fails before it (the backend refusing the request: 429 overloaded, 404 an adapter it
    does not hold, 503 no backend) raises here and keeps its HTTP status, as it would without stream; a
    client gone while it waits cancels the request."""
    try:
        first = await cancel_on_disconnect(request, anext(events))
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise
    return chained(first, events)


async def chained(first: T | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """first (None: nothing), then the rest; closing it closes the rest."""
    try:
        if first is None:
            return
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # a client that went away aborts the backend call now, not at GC


async def _framed(events: AsyncIterator[str], framing: SseFraming) -> AsyncIterator[str]:
    try:
        async for text in events:
            yield framing.event(text)
    except Exception as exc:  # noqa: BLE001 (a bug too ends the stream properly)
        yield framing.error(json.dumps(stream_error_body(exc)))
    finally:
        await events.aclose()  # a client that went away aborts the backend call now, not at GC
    yield framing.end


def aux_info(outputs: list[BackendOutput]) -> dict[str, Any]:
    """RTP-LLM's aux_info from each sequence's latest backend output, every AuxInfo field (times in ms);
    several sequences: output_len summed, input_len/reuse_len the first's, the rest the largest."""
    if not outputs:
        return {}
    out: dict[str, Any] = {}
    for f in fields(AuxInfo):
        values = [getattr(o.aux, f.name) for o in outputs]
        value = sum(values) if f.name == "output_len" else values[0] if f.name in _SHARED else max(values)
        if f.name.endswith("_us"):
            out[f.name[:-3] + "_ms"] = value / 1000
        else:
            out[f.name] = value
    return out


_SHARED = ("input_len", "reuse_len")  # the request's prompt: the same for each of its sequences
