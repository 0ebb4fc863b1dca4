"""OpenAI's Responses API, `/v1/responses`: a thin dialect over the chat one. `input` (text or items),
`instructions` and the stored turns of `previous_response_id` become chat messages; `tools`, `tool_choice`
and `text.format` become chat's tools and response_format (so forced calls and JSON schemas take the
structured-output path); frontend/chat.py renders and frontend/pipeline.py generates. The answer is a
`response` object whose output holds function_call items and a message item; streamed, the typed events
`response.created` → `response.in_progress` → per item `response.output_item.added` (→ content part →
`response.output_text.delta`… / `response.function_call_arguments.delta`… → their `.done`) →
`response.completed`.

Responses are kept for previous_response_id and GET /v1/responses/{id} in this frontend's memory only
(ResponseStore: at most 1,000, each for an hour; `store: false` keeps none).
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend.chat import ChatDialect
from frontend.dialect import Events, GenerationDialect, Job
from frontend.off_loop import off_loop
from frontend.pipeline import PreparedRequest
from frontend.generate_config import INT32_MAX
from frontend.protocol import ChatCompletionRequest, StreamOptions, _Lenient, _refuse_unless
from frontend.respond import RESPONSES_SSE
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import TEMPERATURE_MAX
from renderers.response_stream import ResponseStream, new_call_id, whole_message

STORE_MAX = 1000        # responses kept for previous_response_id (the oldest goes first)
STORE_TTL_S = 3600.0    # and for at most this long


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None   # the model says what it says: only the default


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    store: bool = True                  # keep it for previous_response_id / GET (ResponseStore)
    metadata: dict[str, str] | None = None   # echoed back
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping turns to fit) is not offered
    service_tier: Literal["auto", "default"] | None = None


class ResponseStore:
    """Finished responses and the chat messages that led to each (for previous_response_id), oldest out
    first past STORE_MAX or after STORE_TTL_S. Event-loop only (one owner)."""

    def __init__(self, max_items: int = STORE_MAX, ttl_s: float = STORE_TTL_S) -> None:
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._items[body["id"]] = (time.monotonic(), body, messages)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        self._expire()
        if response_id not in self._items:
            raise KeyError(response_id)
        _, body, messages = self._items[response_id]
        return body, messages

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and now - next(iter(self._items.values()))[0] > self.ttl_s:
            self._items.popitem(last=False)


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or chat parts where it has images (`input_image`, a URL or a
    data: URI, as chat's image_url parts take them; the image checks are chat's)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image":
                _refuse_unless(part.get("file_id") is None, f"{where}.content.{j}.file_id",
                               "uploaded files are not served; send the image as image_url (a URL or a data: URI)")
                _refuse_unless(isinstance(part.get("image_url"), str), f"{where}.content.{j}.image_url",
                               "an input_image needs its image_url")
                image = {"url": part["image_url"], **({"detail": part["detail"]} if "detail" in part else {})}
                parts.append({"type": "image_url", "image_url": image})
                continue
            _refuse_unless(kind in ("input_text", "output_text", "text"), where,
                           f"content parts of type {kind!r} are not supported (text and input_image)")
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{where}: content must be text or content parts", where)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` (text, or message / function_call / function_call_output items) as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            _refuse_unless(role in ("user", "system", "developer", "assistant"), where, f"unknown role {role!r}")
            out.append({"role": role, "content": _content_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or new_call_id(), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{where}: input items of type {kind!r} are not "
                               "supported (message, function_call, function_call_output)", where)
    _refuse_unless(bool(out), "input", "must not be empty")
    return out


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this response is: instructions first (they do not carry over), then the earlier turns."""
    messages = [*([{"role": "system", "content": req.instructions}] if req.instructions else []),
                *history, *input_messages(req)]
    body: dict[str, Any] = {"messages": messages, "model": req.model, "temperature": req.temperature,
                            "top_p": req.top_p, "max_tokens": req.max_output_tokens,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        _refuse_unless(fmt.schema_ is not None, "text.format.schema", "a json_schema format needs its schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                           "input") from None


class _Answer:
    """The response body being built: its output items in order, and usage at the end."""

    def __init__(self, req: ResponsesRequest, prep: PreparedRequest, model: str) -> None:
        self.req, self.prep = req, prep
        self.body: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "metadata": req.metadata or {}, "parallel_tool_calls":
            req.parallel_tool_calls is not False, "temperature": prep.params.temperature, "top_p": prep.params.top_p,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "store": req.store, "user": req.user, "usage": None}

    def message(self) -> dict[str, Any]:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        self.body["output"].append(item)
        return item

    def call(self, call_id: str, name: str) -> dict[str, Any]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
                "arguments": "", "status": "in_progress"}
        self.body["output"].append(item)
        return item

    def finish(self, finish_reason: str | None, completion_tokens: int) -> dict[str, Any]:
        truncated = finish_reason == "length"
        for item in self.body["output"]:
            item["status"] = "incomplete" if truncated else "completed"
        self.body["status"] = "incomplete" if truncated else "completed"
        if truncated:
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        n_in = len(self.prep.rendered.input_ids)
        self.body["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": n_in + completion_tokens}
        return self.body


def _text_part(text: str = "") -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _Turn:
    answer: _Answer
    stream: ResponseStream                   # the model's text → message content and tool calls
    keep: Callable[[dict[str, Any]], None]   # stores the finished response (unless store: false)


class ResponsesDialect(GenerationDialect[_Turn]):
    """/v1/responses over the chat dialect: its request as a chat request, its answer as a response."""
    paths = ("/v1/responses", "/responses")
    request = ResponsesRequest
    framing = RESPONSES_SSE

    def __init__(self, chat: ChatDialect) -> None:
        super().__init__(chat.pipeline)
        self.chat = chat
        self.store = ResponseStore()

    async def parse(self, req: ResponsesRequest, request: Request) -> Job[_Turn]:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            try:
                history = self.store.get(req.previous_response_id)[1]
            except KeyError:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"Previous response with id "
                                   f"'{req.previous_response_id}' not found (responses are kept "
                                   f"{STORE_TTL_S / 3600:g} h, at most {STORE_MAX}, by the frontend that made them)",
                                   "previous_response_id") from None
        creq = chat_request(req, history)
        prep = await off_loop(self.chat.prepare, creq, await self.chat.images(creq))
        messages = [m.model_dump(exclude_none=True) for m in creq.messages if m.role != "system" or
                    not req.instructions or m is not creq.messages[0]]

        def keep(body: dict[str, Any]) -> None:
            if req.store:
                self.store.put(body, [*messages, *_output_messages(body)])

        turn = _Turn(_Answer(req, prep, prep.model or self.pipeline.cfg.model_name),
                     self.chat.renderer.render_response_stream(prep.tool_parser is not None), keep)
        return Job([prep], turn, req.stream, prep.params.constraint, creq)

    async def whole(self, job: Job[_Turn], events: Events) -> dict[str, Any]:
        return await _whole(job.state.answer, job.state.stream, events, job.state.keep)

    def events(self, job: Job[_Turn], events: Events) -> AsyncIterator[str]:
        return _stream(job.state.answer, job.state.stream, events, job.state.keep)

    def more_routes(self, router: APIRouter) -> None:
        @router.get("/v1/responses/{response_id}")
        @router.get("/responses/{response_id}")
        async def retrieve(response_id: str) -> dict[str, Any]:
            try:
                return self.store.get(response_id)[0]
            except KeyError:
                raise StarletteHTTPException(404, f"no response {response_id!r} is kept here") from None


def _output_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The response's output as chat messages, for the turn after it."""
    text = "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in body["output"] if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


async def _whole(answer: _Answer, stream: ResponseStream, events: Events, keep: Callable[[dict[str, Any]], None]
                 ) -> dict[str, Any]:
    texts, finish, tokens = [], None, 0
    async for _, ev in events:
        texts.append(ev.text)
        tokens = ev.completion_tokens
        finish = ev.finish_reason or finish
    content, calls = whole_message(stream, "".join(texts))
    text = content or ""
    for call in calls:
        answer.call(call["id"], call["function"]["name"])["arguments"] = call["function"]["arguments"]
    if text or not calls:
        answer.message()["content"].append(_text_part(text))
    body = answer.finish(finish, tokens)
    keep(body)
    return body


async def _stream(answer: _Answer, stream: ResponseStream, events: Events, keep: Callable[[dict[str, Any]], None]
                  ) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": seq - 1, **fields},
                                                      ensure_ascii=False)

    yield event("response.created", response=answer.body)
    yield event("response.in_progress", response=answer.body)
    message: dict[str, Any] | None = None
    open_calls: dict[int, dict[str, Any]] = {}
    finish, tokens = None, 0

    def index(item: dict[str, Any]) -> int:
        return answer.body["output"].index(item)

    async for _, ev in events:
        tokens = ev.completion_tokens
        finish = ev.finish_reason or finish
        deltas = stream.feed(ev.text) + (stream.finish() if ev.finish_reason is not None else [])
        for delta in deltas:
            if "content" in delta and delta["content"]:
                if message is None:
                    message = answer.message()
                    yield event("response.output_item.added", output_index=index(message), item=message)
                    message["content"].append(_text_part())
                    yield event("response.content_part.added", item_id=message["id"], output_index=index(message),
                                content_index=0, part=_text_part())
                message["content"][0]["text"] += delta["content"]
                yield event("response.output_text.delta", item_id=message["id"], output_index=index(message),
                            content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls", []):
                if call["index"] not in open_calls:
                    item = answer.call(call["id"], call["function"]["name"])
                    open_calls[call["index"]] = item
                    yield event("response.output_item.added", output_index=index(item), item=dict(item))
                item = open_calls[call["index"]]
                piece = call["function"].get("arguments", "")
                if piece:
                    item["arguments"] += piece
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index(item), delta=piece)
    body = answer.finish(finish, tokens)
    for item in body["output"]:
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_text.done", item_id=item["id"], output_index=index(item), content_index=0,
                        text=part["text"], logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index(item), content_index=0,
                        part=part)
        else:
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index(item),
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index(item), item=item)
    keep(body)
    yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
