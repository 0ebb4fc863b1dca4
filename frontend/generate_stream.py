"""BentoML-style `POST /generate`: a plain-text prompt in, the completion streamed back as it is generated.

The body is the prompt itself (no chat template); options come as query parameters. The answer is
plain text (`curl -N` shows it arrive), or Server-Sent Events when the client accepts
`text/event-stream`: `event: message` with one `data:` line per line of the new text, then `event: end`.
Failures before the first text are ordinary HTTP errors (the error table); after it, SSE sends an
`event: error` and plain text cuts the chunked transfer short.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from frontend.backend_client import GenerateParams
from frontend.config import FrontendConfig
from frontend.errors import stream_error_body
from frontend.guided import refuse_constraints
from frontend.metered_router import MeteredRouter
from frontend.off_loop import off_loop
from frontend.protocol import INT32_MAX, INT64_MAX
from frontend.routing import model_to_route
from frontend.stop_strings import StopStringMatcher
from kvyard.detokenize import IncrementalDetokenizer
from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer

log = logging.getLogger("kvyard.frontend")

DEFAULT_MAX_TOKENS = 128
SSE_END = "event: end\n\n"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what SSE itself treats as the end of a line


def sse_message(text: str, event: str = "message") -> str:
    """One SSE event; every line of `text` its own `data:` line, so a reader joins them back with \\n."""
    return f"event: {event}\n" + "".join(f"data: {line}\n" for line in _LINE_BREAK.split(text)) + "\n"


def generate_stream_routes(cfg: FrontendConfig, tokenizer: TextTokenizer, client: MeteredRouter) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request,
                       max_tokens: int = Query(DEFAULT_MAX_TOKENS, ge=1, le=INT32_MAX),
                       temperature: float = Query(1.0, ge=0.0),
                       top_p: float = Query(1.0, gt=0.0, le=1.0),
                       top_k: int = Query(0, ge=0, le=INT32_MAX),
                       seed: int | None = Query(None, ge=-INT64_MAX - 1, le=INT64_MAX),
                       model: str | None = Query(None)) -> StreamingResponse:
        refuse_constraints(request.query_params.keys(), "/generate")
        model = model_to_route(cfg, model)
        try:
            prompt = (await request.body()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the body must be UTF-8 text ({exc})") from None
        ids = await off_loop(tokenizer.encode, prompt)
        if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
        if not ids:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "the prompt (the request body) is empty")
        room = cfg.max_seq_len - len(ids)
        if room <= 0:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, f"This model's maximum context length is "
                               f"{cfg.max_seq_len} tokens; the prompt has {len(ids)}.")
        params = GenerateParams(max_new_tokens=min(max_tokens, room), temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop_sequences=[list(s) for s in cfg.stop_word_ids],
                                timeout_ms=int(cfg.request_timeout_s * 1000))
        chunks = _text(client, tokenizer, ids, params, list(cfg.stop_words), model)
        first = await anext(chunks, None)  # errors up to the first text still get their HTTP status
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if "text/event-stream" in request.headers.get("accept", ""):
            return StreamingResponse(_sse(first, chunks), media_type="text/event-stream", headers=headers)
        return StreamingResponse(_plain(first, chunks), media_type="text/plain; charset=utf-8", headers=headers)

    return router


async def _text(client: MeteredRouter, tokenizer: TextTokenizer, ids: list[int], params: GenerateParams,
                stop_strings: list[str], model: str | None) -> AsyncIterator[str]:
    """The completion's text as it is generated: never empty pieces, stop strings cut off."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids)
    stops = StopStringMatcher(stop_strings)
    gen = client.generate(f"generate-{uuid.uuid4().hex}", ids, params, model)
    try:
        async for outs in gen:
            for out in outs:
                text = stops.feed(detok.push(out.token_ids))
                if out.finish_reason is not None and not stops.stopped:
                    text += stops.feed(detok.flush()) + stops.flush()
                if text:
                    yield text
                if stops.stopped:
                    return  # closing the backend stream aborts the rest
    finally:
        await gen.aclose()


async def _plain(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        if first is None:
            return
        yield first
        async for text in rest:
            yield text
    except RequestError as exc:
        log.warning("/generate failed mid-stream (%s); cutting the response short", exc.message)
        raise
    finally:
        await rest.aclose()  # a client that went away aborts the backend call now, not at GC


async def _sse(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        if first is not None:
            yield sse_message(first)
            async for text in rest:
                yield sse_message(text)
    except Exception as exc:  # noqa: BLE001 (headers are gone: an error event, then end)
        yield sse_message(json.dumps(stream_error_body(exc)), event="error")
    finally:
        await rest.aclose()
    yield SSE_END
