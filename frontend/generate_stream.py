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
from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import StreamingResponse
from starlette.responses import Response

from frontend.dialect import Events, GenerationDialect, Job
from frontend.guided import refuse_constraints
from frontend.off_loop import off_loop
from frontend.pipeline import Budget
from frontend.generate_config import GenerateQuery
from frontend.protocol import SamplingRequest
from frontend.respond import EVENT_SSE, SSE_HEADERS, chained, sse_response
from kvyard.errors import ErrorCode, RequestError
from kvyard.sampling_params import DIALECT_DEFAULTS, Dialect

log = logging.getLogger("kvyard.frontend")


class GenerateDialect(GenerationDialect[None]):
    paths = ("/generate",)
    request = Annotated[GenerateQuery, Query()]

    async def parse(self, query: GenerateQuery, request: Request) -> Job[None]:
        pipeline = self.pipeline
        refuse_constraints(request.query_params.keys(), "/generate")
        model = pipeline.check_model(query.model)  # None: this frontend's own (no name, or SGLang's placeholder)
        try:
            prompt = (await request.body()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the body must be UTF-8 text ({exc})") from None
        # BentoML's service keeps a long prompt's last context - max_new_tokens - 1 tokens (left-truncation);
        # a max_tokens that leaves no room at all is still the 400 every dialect gives.
        max_tokens = query.max_tokens or DIALECT_DEFAULTS[Dialect.GENERATE]["max_new_tokens"]
        room = pipeline.cfg.max_seq_len - max_tokens - 1
        sampling = SamplingRequest.model_construct(**query.sampling_fields(), model=model,
                                                   truncate_prompt_tokens=room if room >= 1 else None)
        prep = pipeline.prepare(f"generate-{uuid.uuid4().hex}", await off_loop(pipeline.tokens, prompt), sampling,
                                Budget(query.max_tokens), dialect=Dialect.GENERATE)
        return Job([prep], None)

    async def respond(self, request: Request, job: Job[None], events: Events) -> Response:
        """Plain text, or SSE when the client accepts it; errors up to the first text keep their HTTP status."""
        chunks = _text(events)
        first = await anext(chunks, None)
        if "text/event-stream" in request.headers.get("accept", ""):
            return sse_response(chained(first, chunks), EVENT_SSE)
        return StreamingResponse(_plain(chained(first, chunks)), media_type="text/plain; charset=utf-8",
                                 headers=SSE_HEADERS)


async def _text(events: Events) -> AsyncIterator[str]:
    """The completion's text as it is generated: never empty pieces (stop strings are cut off already)."""
    try:
        async for _, ev in events:
            if ev.text:
                yield ev.text
    finally:
        await events.aclose()


async def _plain(pieces: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for text in pieces:
            yield text
    except RequestError as exc:
        log.warning("/generate failed mid-stream (%s); cutting the response short", exc.message)
        raise
    finally:
        await pieces.aclose()
