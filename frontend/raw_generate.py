"""RTP-LLM's raw `POST /`: `{"prompt", "generate_config"}` in, `{"response", "finished", "aux_info"}` out.

A list of prompts is a batch (`{"response_batch": [...]}`); `generate_config.num_return_sequences` > 0
makes `response` and `aux_info` lists, one per sequence. Streaming (`generate_config.is_streaming` or
`stream`) sends `data:{...}` events carrying the text so far (`incremental: true`: only the new text),
then `data:[done]`, as RTP-LLM does; an error after the first event is a `data:{"error": ...}` event.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from frontend.backend_client import BackendOutput
from frontend.chat import ChatService, PreparedRequest
from frontend.chat_response import aux_info
from frontend.completions import SSE_HEADERS, merged, prompt_ids, raw_prompt
from frontend.disconnect import cancel_on_disconnect
from frontend.errors import stream_error_body
from frontend.guided import constraint_for
from frontend.off_loop import off_loop
from frontend.protocol import RawRequest, SamplingRequest

Key = tuple[int, int]   # (prompt number, sequence number)


class _State:
    """Every sequence's text, finish and latest backend output, shaped as RTP-LLM answers."""

    def __init__(self, req: RawRequest, preps: list[PreparedRequest]) -> None:
        self.req, self.preps = req, preps
        self.n = preps[0].params.n
        keys = [(i, s) for i in range(len(preps)) for s in range(self.n)]
        self.text: dict[Key, str] = dict.fromkeys(keys, "")
        self.ids: dict[Key, list[int]] = {k: [] for k in keys}
        self.finished: dict[Key, bool] = dict.fromkeys(keys, False)
        self.last: dict[Key, BackendOutput | None] = dict.fromkeys(keys)

    def body(self, texts: dict[Key, str] | None = None) -> dict[str, Any]:
        """The whole answer; `texts` replaces the text so far (a stream's increments)."""
        texts = self.text if texts is None else texts
        cfg = self.req.generate_config
        items = []
        for i, prep in enumerate(self.preps):
            keys = [(i, s) for s in range(self.n)]
            aux = [aux_info([o]) if (o := self.last[k]) is not None else {} for k in keys]
            item: dict[str, Any] = {"finished": all(self.finished[k] for k in keys)}
            if cfg.num_return_sequences:
                item.update(response=[texts.get(k, "") for k in keys], aux_info=aux)
            else:
                item.update(response=texts.get(keys[0], ""), aux_info=aux[0])
            if cfg.return_output_ids:
                item["output_ids"] = [self.ids[k] for k in keys]
            if cfg.return_input_ids:
                item["input_ids"] = [prep.rendered.input_ids]
            items.append(item)
        return {"response_batch": items} if isinstance(self.req.prompt, list) else items[0]


def raw_routes(chat: ChatService) -> APIRouter:
    router = APIRouter()

    @router.post("/")
    async def raw(req: RawRequest, request: Request) -> Any:
        state = _State(req, await off_loop(_prepare, chat, req))
        request.app.state.admission.hold(request.scope, sum(p.params.n for p in state.preps))
        if req.streaming:
            return StreamingResponse(_events(chat, state), media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(await cancel_on_disconnect(request, _collect(chat, state)))

    return router


def _prepare(chat: ChatService, req: RawRequest) -> list[PreparedRequest]:
    model = chat.model(req.model)
    cfg = req.generate_config
    sampling = SamplingRequest(extra_configs=cfg)   # every field from generate_config
    request_id = f"raw-{uuid.uuid4().hex}"
    constraint = constraint_for(req)
    preps = []
    for i, prompt in enumerate([req.prompt] if isinstance(req.prompt, str) else req.prompt):
        text, ids = prompt_ids(chat, prompt)
        max_new = chat.budget(len(ids), cfg.max_new_tokens, "generate_config.max_new_tokens", "prompt")
        params = chat.params(sampling, max_new, False, 0)
        params.constraint = constraint
        preps.append(PreparedRequest(f"{request_id}-{i}", raw_prompt(text, ids), params,
                                     chat.stop_strings(sampling), model))
    return preps


async def _collect(chat: ChatService, state: _State) -> dict[str, Any]:
    async for _ in _updates(chat, state):
        pass
    return state.body()


async def _updates(chat: ChatService, state: _State) -> AsyncIterator[tuple[Key, str]]:
    """Applies each event to the state; yields (sequence, new text) whenever something changed."""
    async for i, ev in merged(chat, state.preps):
        key = (i, ev.index)
        state.text[key] += ev.text
        state.ids[key].extend(ev.token_ids)
        state.last[key] = ev.backend or state.last[key]
        state.finished[key] = state.finished[key] or ev.finish_reason is not None
        if ev.text or ev.finish_reason is not None:
            yield key, ev.text


async def _events(chat: ChatService, state: _State) -> AsyncIterator[str]:
    try:
        async for key, new in _updates(chat, state):
            body = state.body({key: new}) if state.req.incremental else state.body()
            yield f"data:{json.dumps(body, ensure_ascii=False)}\n\n"
    except Exception as exc:  # noqa: BLE001 (headers are gone: an error event, then [done])
        yield f"data:{json.dumps(stream_error_body(exc))}\n\n"
    yield "data:[done]\n\n"
