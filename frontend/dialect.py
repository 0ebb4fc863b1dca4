"""The one interface every generation dialect implements, and the one place the frontend's routes are
registered. A dialect translates its request in (`parse` → a Job: the pipeline's PreparedRequests) and its
wire format out (`whole` / `events`, or its own `respond`); `run` does the steps every dialect shares, in
one order: parse → the constraint's check → an admission slot per sequence → `started` (work that needs
the slots: prompt logprobs) → Pipeline.generate_many → a stream's first event (what fails before it keeps its
HTTP status) → respond. Registering a dialect (Routes.add) adds its paths, the admission middleware's list of
generation paths, and its streaming answer to the OpenAPI doc."""
from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import APIRouter, Request
from starlette.responses import Response

from frontend.guided import check
from frontend.openapi_doc import SSE_RESPONSE
from frontend.pipeline import ChoiceEvent, Pipeline, PreparedRequest
from frontend.protocol import GuidedDecoding
from frontend.respond import OPENAI_SSE, SseFraming, first_come, respond
from kvyard.constraint import Constraint

S = TypeVar("S")
Events = AsyncIterator[tuple[int, ChoiceEvent]]  # Pipeline.generate_many: (position in Job.preps, event)


@dataclass
class Job(Generic[S]):
    """One request, prepared: what to generate, and what its dialect keeps to answer it."""
    preps: list[PreparedRequest]          # generated together; events are tagged with the position here
    state: S                              # the dialect's own record (its request, ids, the model to echo)
    stream: bool = False                  # answer as Server-Sent Events
    constraint: Constraint | None = None  # checked once, before anything is generated (frontend/guided.py)
    fields: GuidedDecoding | None = None  # the request fields the constraint came from (its error names one)
    sequences: int | None = None          # admission slots (None: each prep's n)

    def slots(self) -> int:
        return sum(p.params.n for p in self.preps) if self.sequences is None else self.sequences


class GenerationDialect(Generic[S]):
    """A dialect over frontend/pipeline.py. Subclasses set `paths` and `request` (the handler's parameter:
    a body model, or `Annotated[Model, Query()]`) and implement parse and whole/events (or respond)."""
    paths: tuple[str, ...] = ()
    request: Any = None
    framing: SseFraming = OPENAI_SSE   # how `events` go on the wire

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def parse(self, req: Any, request: Request) -> Job[S]:
        """The request → its prepared generations (CPU work off the event loop: frontend/off_loop.py)."""
        raise NotImplementedError

    async def started(self, job: Job[S]) -> None:
        """Work after admission, before generating (the prompt's logprobs)."""

    async def whole(self, job: Job[S], events: Events) -> dict[str, Any]:
        raise NotImplementedError

    def events(self, job: Job[S], events: Events) -> AsyncIterator[str]:
        raise NotImplementedError

    async def respond(self, request: Request, job: Job[S], events: Events) -> Response:
        return await respond(request, job.stream, lambda: self.events(job, events), lambda: self.whole(job, events),
                             self.framing)

    def more_routes(self, router: APIRouter) -> None:
        """The dialect's routes that generate nothing (chat's /v1/chat/render, GET /v1/responses/{id})."""


async def run(dialect: GenerationDialect[Any], req: Any, request: Request) -> Response:
    """The steps every dialect shares, in order."""
    job = await dialect.parse(req, request)
    if job.fields is not None:
        await check(job.constraint, job.fields)
    request.app.state.admission.hold(request.scope, job.slots())
    await dialect.started(job)
    events = dialect.pipeline.generate_many(job.preps)
    if job.stream:  # its 200 waits for the first token: a refusal before it keeps its status
        events = await first_come(request, events)
    return await dialect.respond(request, job, events)


class Routes:
    """Every route of the frontend's dialects: `router` for the app, `generation` for the admission middleware
    (the paths that generate: counted against CONCURRENCY_LIMIT and refused while draining)."""

    def __init__(self) -> None:
        self.router = APIRouter()
        self.generation: set[str] = set()

    def add(self, dialect: GenerationDialect[Any]) -> None:
        handle = _handler(dialect)
        for path in dialect.paths:
            self.router.add_api_route(path, handle, methods=["POST"], openapi_extra=SSE_RESPONSE)
        self.generation.update(dialect.paths)
        dialect.more_routes(self.router)

    def include(self, router: APIRouter, generation: tuple[str, ...] = ()) -> None:
        """Routes that are not a generation dialect's (pooling) or not HTTP (LMTP's WebSocket)."""
        self.router.include_router(router)
        self.generation.update(generation)


def _handler(dialect: GenerationDialect[Any]) -> Callable[..., Awaitable[Response]]:
    async def handle(req: Any, request: Request) -> Response:
        return await run(dialect, req, request)

    # FastAPI reads the parameters from the signature: the dialect's request model (body or query).
    handle.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("req", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=dialect.request),
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)],
        return_annotation=Response)
    handle.__name__ = f"{type(dialect).__name__}_{dialect.paths[0].strip('/').replace('/', '_') or 'root'}"
    return handle
