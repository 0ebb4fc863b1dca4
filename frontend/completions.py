"""`/v1/completions` (OpenAI's legacy text completions): a prompt as text or token ids, no chat template.

Several prompts run concurrently; choice `index` = prompt number × n + sequence number. `echo` puts the
prompt in front of each choice's text; with `logprobs` the prompt's tokens get theirs from the backend's
ScoreCall (the first one has none, as in OpenAI), which is how evaluation harnesses score text with
`echo: true, max_tokens: 0`. Generation itself goes through ChatService.generate (stop strings, UTF-8).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from frontend.backend_client import TokenLogprob
from frontend.chat import ChatService, ChoiceEvent, PreparedRequest
from frontend.disconnect import cancel_on_disconnect
from frontend.errors import stream_error_body
from frontend.guided import constraint_for
from frontend.off_loop import off_loop
from frontend.protocol import CompletionRequest
from kvyard.errors import ErrorCode, RequestError
from renderers import RenderedPrompt

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class _Job:
    """One prompt of the request."""
    number: int                    # its position in the request's prompt list
    text: str                      # the prompt as text (decoded when given as ids), for echo
    ids: list[int]                 # the prompt's token ids
    prep: PreparedRequest | None   # None: max_tokens 0 (echo only, nothing generated)
    echo_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per prompt token, when asked


def prompt_ids(chat: ChatService, prompt: str | list[int]) -> tuple[str, list[int]]:
    """(text, ids) of one prompt; BOS added to text prompts when the model wants it."""
    tok = chat.tokenizer
    if isinstance(prompt, str):
        ids = tok.encode(prompt, parse_special=True)
        if tok.add_bos_token and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id, *ids]
        text = prompt
    else:
        try:
            tok.check_ids(prompt)
        except ValueError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "prompt") from None
        ids, text = list(prompt), tok.decode(prompt)
    if not ids:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt is empty", "prompt")
    return text, ids


def raw_prompt(text: str, ids: list[int]) -> RenderedPrompt:
    return RenderedPrompt(prompt=text, input_ids=ids, stop_words=[], renderer="none", template_source="none")


async def merged(chat: ChatService, preps: list[PreparedRequest]) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    """ChatService.generate of several requests at once, events tagged with the request's position.
    Closing this closes every one of them (and so aborts their backend calls)."""
    if len(preps) == 1:
        gen = chat.generate(preps[0])
        try:
            async for ev in gen:
                yield 0, ev
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, prep: PreparedRequest) -> None:
        try:
            async for ev in chat.generate(prep):
                await queue.put((i, ev))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 (handed to the consumer, which raises it)
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(preps)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def completion_routes(chat: ChatService) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        request_id, jobs = await _prepare(chat, req, lambda n: request.app.state.admission.hold(request.scope, n))
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": chat.model(req.model) or chat.cfg.model_name}
        if req.stream:
            return StreamingResponse(_sse(chat, req, jobs, base), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return JSONResponse(await cancel_on_disconnect(request, _complete(chat, req, jobs, base)))

    return router


async def _prepare(chat: ChatService, req: CompletionRequest, hold: Callable[[int], None]
                   ) -> tuple[str, list[_Job]]:
    """Tokenizes every prompt, holds one admission slot per sequence (hold), then scores echoed prompts."""
    model = chat.model(req.model)
    p = req.prompt
    prompts: list[str | list[int]] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    jobs = []
    constraint = await off_loop(constraint_for, req)  # checked once, before anything is generated
    tokenized = await off_loop(lambda: [prompt_ids(chat, prompt) for prompt in prompts])
    for number, (text, ids) in enumerate(tokenized):
        prep = None
        if req.max_tokens == 0 and req.echo:
            chat.budget(len(ids), None, "max_tokens", "prompt")   # the prompt alone must fit
        else:
            max_new = chat.budget(len(ids), req.max_tokens, "max_tokens", "prompt")
            params = chat.params(req, max_new, req.logprobs is not None, req.logprobs or 0)
            params.constraint = constraint
            prep = PreparedRequest(f"{request_id}-{number}", raw_prompt(text, ids), params,
                                   chat.stop_strings(req), model)
        jobs.append(_Job(number, text, ids, prep))
    hold(sum(job.prep.params.n if job.prep else 1 for job in jobs))
    if req.echo and req.logprobs is not None:
        for job in jobs:
            job.echo_logprobs = await _prompt_logprobs(chat, job.ids, req, f"{request_id}-{job.number}-echo")
    return request_id, jobs


async def _prompt_logprobs(chat: ChatService, ids: list[int], req: CompletionRequest,
                           request_id: str) -> list[TokenLogprob | None]:
    first: list[TokenLogprob | None] = [None]
    if len(ids) == 1:
        return first
    score = await chat.client.score(request_id, ids[:1], ids[1:], chat.model(req.model), req.logprobs or 0)
    return [*first, *score.logprobs]


class _Choice:
    """One choice's text and its logprobs in the legacy shape (tokens, token_logprobs, top_logprobs,
    text_offset)."""

    def __init__(self, chat: ChatService, with_logprobs: bool) -> None:
        self.chat = chat
        self.text = ""
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} \
            if with_logprobs else None

    def add(self, text: str, ids: list[int], lps: list[TokenLogprob | None]) -> dict[str, Any] | None:
        """Append text; returns the logprobs of just these tokens (for a stream chunk)."""
        offset = len(self.text)
        self.text += text
        if self.logprobs is None:
            return None
        piece: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        decode = self.chat.tokenizer.decode
        for token_id, lp in zip(ids, lps):
            token = decode([token_id])
            piece["tokens"].append(token)
            piece["token_logprobs"].append(None if lp is None else lp.logprob)
            piece["top_logprobs"].append(None if lp is None else {decode([t]): v for t, v in lp.top})
            piece["text_offset"].append(offset)
            offset += len(token)
        for key, values in piece.items():
            self.logprobs[key].extend(values)
        return piece


def _echo(job: _Job, choice: _Choice) -> dict[str, Any] | None:
    return choice.add(job.text, job.ids, job.echo_logprobs or [None] * len(job.ids))


async def _complete(chat: ChatService, req: CompletionRequest, jobs: list[_Job],
                    base: dict[str, Any]) -> dict[str, Any]:
    n = _n(req, jobs)
    choices = {(j.number, s): _Choice(chat, req.logprobs is not None) for j in jobs for s in range(n)}
    finish: dict[tuple[int, int], str] = {}
    tokens: dict[tuple[int, int], int] = {}
    if req.echo:
        for (number, _), choice in choices.items():
            _echo(jobs[number], choice)
    running = [j for j in jobs if j.prep is not None]
    if running:
        async for k, ev in merged(chat, [j.prep for j in running if j.prep]):
            key = (running[k].number, ev.index)
            choices[key].add(ev.text, ev.token_ids, list(ev.logprobs) or [None] * len(ev.token_ids))
            tokens[key] = ev.completion_tokens
            if ev.finish_reason is not None:
                finish[key] = ev.finish_reason
    body = [{"index": number * n + s, "text": c.text, "logprobs": c.logprobs,
             "finish_reason": finish.get((number, s), "length")} for (number, s), c in choices.items()]
    return {**base, "choices": body, "usage": _usage(jobs, sum(tokens.values()))}


async def _sse(chat: ChatService, req: CompletionRequest, jobs: list[_Job],
               base: dict[str, Any]) -> AsyncIterator[str]:
    n = _n(req, jobs)

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body = {**base, "choices": choices}
        if req.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    choices = {(j.number, s): _Choice(chat, req.logprobs is not None) for j in jobs for s in range(n)}
    tokens: dict[tuple[int, int], int] = {}
    try:
        for (number, s), choice in choices.items():
            if req.echo:
                lp = _echo(jobs[number], choice)
                done = jobs[number].prep is None
                yield chunk([{"index": number * n + s, "text": choice.text, "logprobs": lp,
                              "finish_reason": "length" if done else None}])
        running = [j for j in jobs if j.prep is not None]
        if running:
            async for k, ev in merged(chat, [j.prep for j in running if j.prep]):
                key = (running[k].number, ev.index)
                tokens[key] = ev.completion_tokens
                if not ev.text and ev.finish_reason is None and not ev.logprobs:
                    continue
                lp = choices[key].add(ev.text, ev.token_ids, list(ev.logprobs) or [None] * len(ev.token_ids))
                yield chunk([{"index": key[0] * n + key[1], "text": ev.text, "logprobs": lp,
                              "finish_reason": ev.finish_reason}])
    except Exception as exc:  # noqa: BLE001 (headers are gone: an error chunk, then [DONE])
        yield f"data: {json.dumps(stream_error_body(exc))}\n\n"
        yield "data: [DONE]\n\n"
        return
    if req.include_usage:
        yield chunk([], _usage(jobs, sum(tokens.values())))
    yield "data: [DONE]\n\n"


def _n(req: CompletionRequest, jobs: list[_Job]) -> int:
    """Sequences per prompt (extra_configs.num_return_sequences may ask for them too)."""
    return next((j.prep.params.n for j in jobs if j.prep), req.n)


def _usage(jobs: list[_Job], completion_tokens: int) -> dict[str, int]:
    n_prompt = sum(len(j.ids) for j in jobs)
    return {"prompt_tokens": n_prompt, "completion_tokens": completion_tokens,
            "total_tokens": n_prompt + completion_tokens}
