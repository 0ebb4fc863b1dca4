"""BentoML-style `POST /generate`: a plain-text prompt in, the completion streamed back as it is generated.

The body is the prompt itself (no chat template), tokenized and budgeted as every text prompt is
(frontend/pipeline.py: special tokens parsed, BOS once; a max_tokens past the context is a 400, as in the
other dialects), except that a prompt longer than context - max_tokens - 1 keeps its last that many tokens,
as BentoML's service does; options come as query parameters. The answer is
plain text (`curl -N` shows it arrive), or Server-Sent Events when the client accepts
`text/event-stream`: `event: message` with one `data:` line per line of the new text, then `event: end`.
Failures before the first text are ordinary HTTP errors (the error table); after it, SSE sends an
`event: error` and plain text cuts the chunked transfer short.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from frontend.guided import refuse_constraints
from frontend.off_loop import off_loop
from frontend.pipeline import Budget, ChoiceEvent, Pipeline
from frontend.generate_config import INT32_MAX, INT64_MAX
from frontend.protocol import SamplingRequest
from frontend.respond import EVENT_SSE, SSE_HEADERS, sse_response
from kvyard.errors import ErrorCode, RequestError
from kvyard.sampling_params import DIALECT_DEFAULTS, Dialect

log = logging.getLogger("kvyard.frontend")


def generate_stream_routes(pipeline: Pipeline) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request,
                       max_tokens: int | None = Query(None, ge=1, le=INT32_MAX),
                       temperature: float | None = Query(None, ge=0.0),
                       top_p: float | None = Query(None, gt=0.0, le=1.0),
                       top_k: int | None = Query(None, ge=0, le=INT32_MAX),
                       seed: int | None = Query(None, ge=-INT64_MAX - 1, le=INT64_MAX),
                       model: str | None = Query(None)) -> StreamingResponse:
        refuse_constraints(request.query_params.keys(), "/generate")
        model = pipeline.check_model(model)  # None: this frontend's own (no name, or SGLang's placeholder)
        try:
            prompt = (await request.body()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the body must be UTF-8 text ({exc})") from None
        # The query's own bounds were checked above (temperature has no upper one here, as before).
        # BentoML's service keeps a long prompt's last context - max_new_tokens - 1 tokens (left-truncation);
        # a max_tokens that leaves no room at all is still the 400 every dialect gives.
        room = pipeline.cfg.max_seq_len - (max_tokens or DIALECT_DEFAULTS[Dialect.GENERATE]["max_new_tokens"]) - 1
        sampling = SamplingRequest.model_construct(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                                   model=model, truncate_prompt_tokens=room if room >= 1 else None)
        prep = pipeline.prepare(f"generate-{uuid.uuid4().hex}", await off_loop(pipeline.tokens, prompt), sampling,
                                Budget(max_tokens), dialect=Dialect.GENERATE)
        chunks = _text(pipeline.generate(prep))
        first = await anext(chunks, None)  # errors up to the first text still get their HTTP status
        if "text/event-stream" in request.headers.get("accept", ""):
            return sse_response(_pieces(first, chunks), EVENT_SSE)
        return StreamingResponse(_plain(_pieces(first, chunks)), media_type="text/plain; charset=utf-8",
                                 headers=SSE_HEADERS)

    return router


async def _text(events: AsyncIterator[ChoiceEvent]) -> AsyncIterator[str]:
    """The completion's text as it is generated: never empty pieces (stop strings are cut off already)."""
    try:
        async for ev in events:
            if ev.text:
                yield ev.text
    finally:
        await events.aclose()


async def _pieces(first: str | None, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        if first is None:
            return
        yield first
        async for text in rest:
            yield text
    finally:
        await rest.aclose()  # a client that went away aborts the backend call now, not at GC


async def _plain(pieces: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for text in pieces:
            yield text
    except RequestError as exc:
        log.warning("/generate failed mid-stream (%s); cutting the response short", exc.message)
        raise
    finally:
        await pieces.aclose()
