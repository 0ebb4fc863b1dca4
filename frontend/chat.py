"""The OpenAI chat dialect: `/v1/chat/completions` (and `/v1/chat/render`) → the rendered prompt →
frontend/pipeline.py → its choice events as one chat.completion body or SSE chunks.

Streaming: a first chunk with each choice's role, then one chunk per piece of content or tool-call delta,
finish_reason exactly once per choice, `usage: null` on every chunk and a last `choices: []` chunk with
the usage when `stream_options.include_usage`; an error after the headers went out is a
`data: {"error": ...}` chunk, then `data: [DONE]` (frontend/respond.py).
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from frontend.backend_client import BackendOutput
from frontend.dialect import Events, GenerationDialect, Job
from frontend.guided import chat_constraint, check
from frontend.images import LoadedImage, with_images
from frontend.off_loop import off_loop
from frontend.pipeline import Budget, Pipeline, PreparedRequest
from frontend.protocol import ChatCompletionRequest, ImagePart
from frontend.respond import aux_info
from frontend.logprobs import logprob_entries, prompt_logprob_entries
from kvyard.errors import ErrorCode, RequestError
from renderers import ChatRenderer, RenderedPrompt, RenderRequest
from renderers.response_stream import whole_message

@dataclass
class ChatState:
    """What a chat answer needs besides its events."""
    req: ChatCompletionRequest
    prep: PreparedRequest
    model: str                                   # echoed back
    prompt_logprobs: list[Any] | None = None     # the prompt's own, when asked (ChatDialect.started)


class ChatDialect(GenerationDialect[ChatState]):
    """A chat request → the pipeline's prepare call: its messages rendered by the model's chat template."""
    paths = ("/v1/chat/completions", "/chat/completions")
    request = ChatCompletionRequest

    def __init__(self, pipeline: Pipeline, renderer: ChatRenderer) -> None:
        super().__init__(pipeline)
        self.renderer = renderer

    async def images(self, req: ChatCompletionRequest) -> list[LoadedImage]:
        """The messages' image parts, fetched and checked (before prepare, which runs off the event loop)."""
        parts = [(f"messages[{i}].content[{j}]", part.image_url) for i, m in enumerate(req.messages)
                 if isinstance(m.content, list) for j, part in enumerate(m.content) if isinstance(part, ImagePart)]
        for where, url in parts:
            if url.detail == "low":
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{where}.image_url.detail: 'low' is not supported: "
                                   "the model sees every image at its one, full resolution (use 'auto' or 'high')",
                                   f"{where}.image_url.detail")
        return await self.pipeline.images([(where, url.url) for where, url in parts])

    async def tokens(self, req: ChatCompletionRequest) -> RenderedPrompt:
        """The prompt's ids as this request would send them, each image part its run of placeholders
        (/tokenize: the count a request is billed)."""
        images = await self.images(req)
        return with_images(await off_loop(self.render, req), images, self.pipeline.cfg.vision, "messages")

    def render(self, req: ChatCompletionRequest) -> RenderedPrompt:
        placeholder = self.pipeline.image_placeholder  # each image part: the model's image token
        messages = [{**m.model_dump(exclude_none=True), "content": m.text(placeholder)} for m in req.messages]
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
        template = req.user_template
        if req.chat_template is not None:
            # As vLLM: a template from the request runs only where the operator trusts request templates.
            if not self.pipeline.cfg.trust_request_chat_template:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "chat_template from the request is not trusted on "
                                   "this server (the operator sets TRUST_REQUEST_CHAT_TEMPLATE=1)", "chat_template")
            if template is not None:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "give chat_template or user_template, not both",
                                   "chat_template")
            template = req.chat_template
        rendered = self.renderer.render(RenderRequest(
            messages=messages, add_generation_prompt=req.add_generation_prompt,
            tools=req.tools_in_use(), tool_choice=choice,
            template_key=req.template_key, user_template=template,
            chat_template_kwargs=req.template_kwargs(),
            functions=[f.model_dump(exclude_none=True) for f in req.functions] if req.legacy_functions else None))
        return self._continued(rendered, req.messages[-1].text()) if req.continue_final_message else rendered

    def _continued(self, rendered: RenderedPrompt, last: str) -> RenderedPrompt:
        """continue_final_message: the prompt ends right after the last message's text (the template's
        end-of-turn after it is cut), so the model goes on with that message."""
        start = rendered.prompt.rfind(last) if last else -1
        if start < 0:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the chat template does not show the last message's "
                               "text, so it cannot be continued", "continue_final_message")
        tokens = self.pipeline.tokens(rendered.prompt[:start + len(last)])
        return dataclasses.replace(rendered, prompt=tokens.prompt, input_ids=tokens.input_ids)

    def prepare(self, req: ChatCompletionRequest, images: Sequence[LoadedImage] = ()) -> PreparedRequest:
        self.pipeline.check_model(req.model)
        if req.stream and req.prompt_logprobs is not None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "prompt_logprobs are not available with stream: true",
                               "prompt_logprobs")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        parser = self.renderer.tool_parser
        request_id = req.backend_request_id("chatcmpl")
        rendered = self.render(req)
        req.log_prompt(request_id, rendered.prompt, len(rendered.input_ids))
        return self.pipeline.prepare(
            request_id, rendered, req, Budget(req.requested_max_tokens(), param, "messages"),
            logprobs=req.logprobs, top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            constraint=chat_constraint(req, parser), tool_parser=parser if req.tools_in_use() else None,
            images=images)

    async def parse(self, req: ChatCompletionRequest, request: Request) -> Job[ChatState]:
        prep = await off_loop(self.prepare, req, await self.images(req))
        return Job([prep], ChatState(req, prep, prep.model or self.pipeline.cfg.model_name), req.stream,
                   prep.params.constraint, req)

    async def started(self, job: Job[ChatState]) -> None:
        prep = job.state.prep
        if prep.prompt_logprobs is not None:
            job.state.prompt_logprobs = prompt_logprob_entries(await self.pipeline.prompt_logprobs(
                f"{prep.request_id}-prompt", prep.rendered.input_ids, prep.model, prep.prompt_logprobs,
                prep.params.adapter),
                self.pipeline.tokenizer)

    async def whole(self, job: Job[ChatState], events: Events) -> dict[str, Any]:
        return await _body(self, job.state, events)

    def events(self, job: Job[ChatState], events: Events) -> AsyncIterator[str]:
        return _chunks(self, job.state, events)

    def more_routes(self, router: APIRouter) -> None:
        @router.post("/v1/chat/render")
        @router.post("/chat/render")
        async def chat_render(req: ChatCompletionRequest) -> dict[str, Any]:
            prep = await off_loop(self.prepare, req, await self.images(req))
            await self.pipeline.check_served(prep.model, prep.params.adapter)  # what routing it would 404
            await check(prep.params.constraint, req)
            return render_info(self, prep, req)


async def _body(chat: ChatDialect, state: ChatState, events: Events) -> dict[str, Any]:
    req, prep = state.req, state.prep
    n = prep.params.n
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    logprobs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    finish: dict[int, str] = {}
    stop_reasons: dict[int, int | str | None] = {}
    tokens: dict[int, int] = {}
    last: dict[int, BackendOutput] = {}
    async for _, ev in events:
        texts[ev.index].append(ev.text)
        ids[ev.index].extend(ev.token_ids)
        tokens[ev.index] = ev.completion_tokens
        logprobs[ev.index].extend(logprob_entries(ev.logprobs, chat.pipeline.tokenizer, req.return_tokens_as_token_ids))
        if ev.backend is not None:
            last[ev.index] = ev.backend
        if ev.finish_reason is not None:
            finish[ev.index] = ev.finish_reason
            stop_reasons[ev.index] = ev.stop_reason
    choices = []
    for i in range(n):
        text, reason = "".join(texts[i]), finish.get(i, "stop")
        content, calls = whole_message(chat.renderer.render_response_stream(prep.tool_parser is not None), text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls and req.legacy_functions:  # OpenAI's legacy answer: one function_call
            message["function_call"] = calls[0]["function"]
            reason = "function_call" if reason == "stop" else reason
        elif calls:
            message["tool_calls"] = calls
            reason = "tool_calls" if reason == "stop" else reason
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": logprobs[i]} if prep.params.logprobs else None,
                        "finish_reason": reason, "stop_reason": stop_reasons.get(i)})
    body = {"id": req.chat_id or prep.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": state.model, "choices": choices, "usage": usage(prep, sum(tokens.values())), **req.echoed()}
    if state.prompt_logprobs is not None:
        body["prompt_logprobs"] = state.prompt_logprobs   # vLLM's place for it
    if req.debug_info:
        body["debug_info"] = {**render_info(chat, prep, req), "output_ids": [ids[i] for i in range(n)],
                              "raw_output": ["".join(texts[i]) for i in range(n)]}
    if req.aux_info:
        body["aux_info"] = aux_info(list(last.values()))
    return body


async def _chunks(chat: ChatDialect, state: ChatState, events: Events) -> AsyncIterator[str]:
    req, prep = state.req, state.prep
    base = {"id": req.chat_id or prep.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model}
    include_usage = req.include_usage

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, int] | None = None, **extra: Any) -> str:
        body = {**base, "choices": choices, **extra}
        if include_usage:
            body["usage"] = usage_
        return json.dumps(body, ensure_ascii=False)

    n = prep.params.n
    first_extra = {**req.echoed(), **({"debug_info": render_info(chat, prep, req)} if req.debug_info else {})}
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(n)], **first_extra)
    streams = {i: chat.renderer.render_response_stream(prep.tool_parser is not None) for i in range(n)}
    tokens: dict[int, int] = {}
    async for _, ev in events:
        tokens[ev.index] = ev.completion_tokens
        stream = streams[ev.index]
        deltas = stream.feed(ev.text) + (stream.finish() if ev.finish_reason is not None else [])
        if not deltas and ev.finish_reason is None and not ev.logprobs:
            continue  # e.g. half a UTF-8 character or a possible stop string held back
        reason = ev.finish_reason
        if reason == "stop" and stream.calls:
            reason = "function_call" if req.legacy_functions else "tool_calls"
        if req.legacy_functions:
            deltas = [_as_function_call(d) for d in deltas]
        deltas = deltas or [{}]
        for k, delta in enumerate(deltas):
            is_last = k == len(deltas) - 1
            lp = None
            if prep.params.logprobs:
                lp = {"content": logprob_entries(ev.logprobs, chat.pipeline.tokenizer, req.return_tokens_as_token_ids) if k == 0 else []}
            extra = {}
            if is_last and reason is not None and req.aux_info and ev.backend is not None:
                extra["aux_info"] = aux_info([ev.backend])
            ends = is_last and reason is not None
            yield chunk([{"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": reason if is_last else None,
                          **({"stop_reason": ev.stop_reason} if ends else {})}], **extra)
    if include_usage:
        yield chunk([], usage(prep, sum(tokens.values())))


def _as_function_call(delta: dict[str, Any]) -> dict[str, Any]:
    """A tool-call delta in OpenAI's legacy shape, {"function_call": {"name", "arguments"}}: the first call
    only, as the legacy API has one."""
    calls = delta.get("tool_calls")
    if calls is None:
        return delta
    out = {k: v for k, v in delta.items() if k != "tool_calls"}
    first = [c for c in calls if c.get("index", 0) == 0]
    if first:
        fn = first[0].get("function", {})
        out["function_call"] = {k: fn[k] for k in ("name", "arguments") if k in fn}
    return out


def render_info(chat: ChatDialect, prep: PreparedRequest, req: ChatCompletionRequest) -> dict[str, Any]:
    """What /chat/render answers, and a response's debug_info: the prompt as the backend receives it (the
    prompt text shows one image placeholder per image; input_ids the run each stands for)."""
    cfg, tok, p = chat.pipeline.cfg, chat.pipeline.tokenizer, prep.params
    urls = [url for m in req.messages for url in m.image_urls()]
    return {
        "input_prompt": prep.rendered.prompt,
        "input_ids": prep.rendered.input_ids,
        "input_urls": [url if not url.startswith("data:") else url[:40] + "..." for url in urls],
        "tokenizer_info": f"{type(tok).__name__}({cfg.tokenizer_path.name}, vocab={tok.vocab_size})",
        "max_seq_len": cfg.max_seq_len,
        "eos_token_id": tok.eos_token_id,
        "stop_words_list": prep.stop_strings,
        "stop_word_ids_list": [list(ids) for ids in p.stop_sequences],
        "renderer_info": {"class_name": prep.rendered.renderer, "template_source": prep.rendered.template_source,
                          "model_type": cfg.model_type, "tool_parser": chat.renderer.tool_parser.name,
                          "tools_in_prompt": prep.rendered.tools_in_prompt},
        "generate_config": p.describe(),
    }


def usage(prep: PreparedRequest, completion_tokens: int) -> dict[str, int]:
    n_prompt = len(prep.rendered.input_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": completion_tokens,
            "total_tokens": n_prompt + completion_tokens}
