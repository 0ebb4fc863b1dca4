"""RTP-LLM's raw `POST /`: `{"prompt", "generate_config"}` in, `{"response", "finished", "aux_info"}` out.

A list of prompts is a batch (`{"response_batch": [...]}`); `generate_config.num_return_sequences` > 0
makes `response` and `aux_info` lists, one per sequence. Streaming (`generate_config.is_streaming` or
`stream`) sends `data:{...}` events carrying the text so far (`incremental: true`: only the new text),
then `data:[done]`, as RTP-LLM does; an error after the first event is a `data:{"error": ...}` event.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from frontend.backend_client import BackendOutput
from frontend.dialect import Events, GenerationDialect, Job
from frontend.guided import constraint_for
from frontend.images import LoadedImage
from frontend.off_loop import off_loop
from frontend.pipeline import Budget, Pipeline, PreparedRequest
from frontend.protocol import RawRequest, SamplingRequest
from frontend.respond import RTP_SSE, aux_info
from kvyard.errors import ErrorCode, RequestError
from kvyard.sampling_params import Dialect

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
        self.echo = req.echoed()   # extend_fields: in the answer, or the stream's first event

    def body(self, texts: dict[Key, str] | None = None) -> dict[str, Any]:
        """The whole answer (the next stream event); `texts` replaces the text so far (a stream's increments)."""
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
        out = {"response_batch": items} if isinstance(self.req.prompt, list) else items[0]
        out.update({"id": self.req.chat_id} if self.req.chat_id else {}, **self.echo)
        self.echo = {}
        return out


class RawDialect(GenerationDialect[_State]):
    paths = ("/",)
    request = RawRequest
    framing = RTP_SSE

    async def parse(self, req: RawRequest, request: Request) -> Job[_State]:
        if req.urls and not isinstance(req.prompt, str):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "urls go with one prompt, not a batch", "urls")
        images = await self.pipeline.images([(f"urls[{i}]", url) for i, url in enumerate(req.urls or [])])
        state = _State(req, await off_loop(_prepare, self.pipeline, req, images))
        return Job(state.preps, state, req.streaming, next((p.params.constraint for p in state.preps), None), req)

    async def whole(self, job: Job[_State], events: Events) -> dict[str, Any]:
        return await _collect(job.state, _updates(job.state, events))

    def events(self, job: Job[_State], events: Events) -> AsyncIterator[str]:
        return _events(job.state, _updates(job.state, events))


def _prepare(pipeline: Pipeline, req: RawRequest, images: list[LoadedImage]) -> list[PreparedRequest]:
    model = pipeline.check_model(req.model)  # None: this frontend's own (no name, or SGLang's placeholder)
    cfg = req.generate_config
    sampling = SamplingRequest(extra_configs=cfg, model=model)   # every field from generate_config
    request_id = req.backend_request_id("raw")
    constraint = constraint_for(req)
    budget = Budget(cfg.max_new_tokens, "generate_config.max_new_tokens")
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    placeholder = pipeline.image_placeholder
    if images and placeholder not in prompts[0]:  # RTP-LLM's urls with a prompt that names no image: in front
        prompts = [f"{placeholder}\n" * len(images) + prompts[0]]
    preps = []
    for i, prompt in enumerate(prompts):
        rendered = pipeline.tokens(prompt)
        req.log_prompt(f"{request_id}-{i}", rendered.prompt, len(rendered.input_ids))
        preps.append(pipeline.prepare(f"{request_id}-{i}", rendered, sampling, budget, constraint=constraint,
                                      dialect=Dialect.RTP, images=images))
    return preps


async def _collect(state: _State, updates: AsyncIterator[tuple[Key, str]]) -> dict[str, Any]:
    async for _ in updates:
        pass
    return state.body()


async def _updates(state: _State, events: Events) -> AsyncIterator[tuple[Key, str]]:
    """Applies each event to the state; yields (sequence, new text) whenever something changed."""
    async for i, ev in events:
        key = (i, ev.index)
        state.text[key] += ev.text
        state.ids[key].extend(ev.token_ids)
        state.last[key] = ev.backend or state.last[key]
        state.finished[key] = state.finished[key] or ev.finish_reason is not None
        if ev.text or ev.finish_reason is not None:
            yield key, ev.text


async def _events(state: _State, updates: AsyncIterator[tuple[Key, str]]) -> AsyncIterator[str]:
    async for key, new in updates:
        body = state.body({key: new}) if state.req.incremental else state.body()
        yield json.dumps(body, ensure_ascii=False)
