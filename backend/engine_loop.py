"""Runs the Engine on its own thread and bridges it to asyncio: one queue of tokens per request.

Everything that reads or changes engine state (scheduler, block pool, KV cache) runs on the engine
thread, between steps: requests come in as _Add/_Abort commands, anything else as a _Call."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from backend.engine import Engine
from backend.pooling_engine import PoolingEngine
from backend.engine_types import (CacheStatus, GenerationRequest, ImportPlan, KVLayout, PoolingRequest,
                                  PoolingResult, ScoreRequest, ScoreResult, TokenOutput)
from kvyard.errors import ErrorCode, RequestError
from kvyard.metrics import BackendMetrics
from kvyard.worker_status import WorkerStatus

log = logging.getLogger("kvyard.engine")
T = TypeVar("T")
Request = GenerationRequest | ScoreRequest | PoolingRequest
Output = TokenOutput | ScoreResult | PoolingResult


@dataclass
class _Add:
    request: Request
    sink: asyncio.Queue[list[Output] | RequestError]
    loop: asyncio.AbstractEventLoop
    unfinished: int = 0  # sequences of this request still generating (engine thread only)
    imported: tuple[ImportPlan, int] | None = None  # decode side: (plan, prompt_len) to join, not add


@dataclass
class _Abort:
    request_id: str
    add: _Add  # the stream that is leaving: a refused duplicate of a running id must not abort it


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    done: asyncio.Future[Any] | None = None  # None: posted, nobody waits for the result
    undo: Callable[[Engine, Any], None] | None = None  # runs instead if the caller left before the result


class EngineLoop:
    """The engine thread owns the Engine (a decoder's Engine, or a pooling model's PoolingEngine, which
    answers the same calls); asyncio code talks to it only through commands."""

    def __init__(self, engine: Engine | PoolingEngine, metrics: BackendMetrics | None = None, model_name: str = "") -> None:
        self.engine = engine
        self.kv_layout: KVLayout = engine.kv_layout()  # fixed: any thread may read it
        # Recorded here, served on /metrics; preemptions is a plain int the engine thread bumps.
        self.metrics = metrics or BackendMetrics(self.worker_status, model_name,
                                                 lambda: engine.num_preemptions)
        self._commands: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
        self._sinks: dict[str, _Add] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._alive = False

    def start(self) -> None:
        self._alive = True
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._alive and self._thread.is_alive()

    def worker_status(self) -> WorkerStatus:
        return self.engine.worker_status(self.alive)

    def cache_status(self, since_version: int) -> CacheStatus:
        return self.engine.cache_status(since_version)

    async def call(self, fn: Callable[[Engine], T], undo: Callable[[Engine, T], None] | None = None) -> T:
        """fn(engine) on the engine thread between two steps; its result (or exception) comes back here.
        A caller that is cancelled while waiting leaves nothing behind: undo(engine, result) runs then."""
        if not self.alive:
            raise RequestError(ErrorCode.UNAVAILABLE, "the engine is not running")
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, done, undo))
        try:
            return await done
        except asyncio.CancelledError:
            # Cancelled after the result was set but before this task ran again: `done` holds a result
            # nobody will take (a cancelled `done` is undone where it is resolved, in _settle).
            if undo is not None and done.done() and not done.cancelled() and done.exception() is None:
                result = done.result()
                self.post(lambda engine: undo(engine, result))
            raise

    def post(self, fn: Callable[[Engine], None]) -> None:
        """fn(engine) on the engine thread, nobody waiting (clean-up from finally blocks; in order with
        every other command)."""
        self._commands.put(_Call(fn))

    async def score(self, request: ScoreRequest) -> ScoreResult:
        result = None
        async for outs in self.generate(request):  # to the end, so the request counts as finished
            result = next((out for out in outs if isinstance(out, ScoreResult)), result)
        if result is None:
            raise RequestError(ErrorCode.INTERNAL, "scoring ended without a result")
        return result

    async def pool(self, request: PoolingRequest) -> PoolingResult:
        result = None
        async for outs in self.generate(request):
            result = next((out for out in outs if isinstance(out, PoolingResult)), result)
        if result is None:
            raise RequestError(ErrorCode.INTERNAL, "pooling ended without a result")
        return result

    async def generate(self, request: Request,
                       imported: tuple[ImportPlan, int] | None = None
                       ) -> AsyncIterator[list[Output]]:
        """_stream with metrics: TTFT, inter-token and end-to-end latency, tokens, prefix-cache reuse."""
        endpoint = ("ScoreCall" if isinstance(request, ScoreRequest) else
                    "PoolCall" if isinstance(request, PoolingRequest) else "GenerateStreamCall")
        timer = self.metrics.timer(request.arrival_time)
        status = ErrorCode.CANCELLED.value  # unless it runs to the end or fails: the caller left
        stream = self._stream(request, imported)
        first = True
        unfinished = request.n
        try:
            async for outs in stream:
                if first and outs:
                    first = False
                    self.metrics.prompt(outs[0].aux.input_len, outs[0].aux.reuse_len)
                    self.metrics.queue_time.observe(outs[0].aux.wait_time_us / 1e6)
                timer.step(sum(1 for out in outs if isinstance(out, TokenOutput)))
                unfinished -= sum(1 for out in outs if out.finish_reason is not None)
                if unfinished <= 0:
                    status = "ok"  # now: the caller may stop reading once it has every finish
                    timer.finish()
                yield outs
        except RequestError as exc:
            status = exc.code.value
            raise
        finally:
            await stream.aclose()
            self.metrics.count(endpoint, status)

    async def _stream(self, request: Request,
                      imported: tuple[ImportPlan, int] | None = None
                      ) -> AsyncIterator[list[Output]]:
        """Yields each step's tokens for this request until every sequence finished.
        Leaving early (cancelled, timed out, consumer gone) aborts it in the engine."""
        self.engine.validate(request)
        if not self.alive:
            raise RequestError(ErrorCode.UNAVAILABLE, "the engine is not running")
        sink: asyncio.Queue[list[Output] | RequestError] = asyncio.Queue()
        add = _Add(request, sink, asyncio.get_running_loop(), imported=imported)
        self._commands.put(add)
        remaining = request.n
        try:
            while remaining:
                item = await sink.get()
                if isinstance(item, RequestError):
                    raise item
                remaining -= sum(1 for out in item if out.finish_reason is not None)
                yield item
        finally:
            if remaining:
                self._commands.put(_Abort(request.request_id, add))

    def _run(self) -> None:
        try:
            while True:
                if not self._apply_commands(block=not self.engine.has_work):
                    return
                try:
                    outputs = self.engine.step()
                except Exception:  # an engine bug must not hang every caller: fail them all loudly
                    log.exception("engine step failed")
                    self._fail_all(RequestError(ErrorCode.INTERNAL, "engine step failed; see backend log"))
                    continue
                self._deliver(outputs)
                self._fail_alone()
        finally:
            self._alive = False
            stopped = RequestError(ErrorCode.UNAVAILABLE, "the engine stopped")
            self._fail_all(stopped)
            self._refuse_queued(stopped)

    def _apply_commands(self, block: bool) -> bool:
        """Returns False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Call):
                self._run_call(cmd)
            elif isinstance(cmd, _Add):
                if cmd.request.request_id in self._sinks:
                    if cmd.imported is not None:
                        self.engine.drop_import(cmd.imported[0])
                    self._send(cmd, RequestError(ErrorCode.INVALID_ARGUMENT,
                                                 f"request_id {cmd.request.request_id!r} is already running"))
                    continue
                cmd.unfinished = cmd.request.n
                self._sinks[cmd.request.request_id] = cmd
                if cmd.imported is not None:
                    self.engine.join_import(*cmd.imported)
                else:
                    try:  # a vision request runs its image tower here: its failure is the request's alone
                        self.engine.add(cmd.request)
                    except Exception as exc:
                        log.exception("adding request %s failed", cmd.request.request_id)
                        self._sinks.pop(cmd.request.request_id, None)
                        self._send(cmd, exc if isinstance(exc, RequestError)
                                   else RequestError(ErrorCode.INTERNAL, "adding the request failed; see backend log"))
            else:
                running = self._sinks.get(cmd.request_id)
                if running is None or running is cmd.add:
                    self.engine.abort(cmd.request_id)
                    self._sinks.pop(cmd.request_id, None)

    def _run_call(self, cmd: _Call) -> None:
        try:
            result, error = cmd.fn(self.engine), None
        except Exception as exc:  # noqa: BLE001 - it belongs to the caller
            result, error = None, exc
        if cmd.done is None:
            if error is not None:
                log.error("engine command failed", exc_info=error)
            return
        self._settle(cmd, result, error)

    def _settle(self, cmd: _Call, result: Any, error: BaseException | None) -> None:
        done = cmd.done
        assert done is not None

        def resolve() -> None:  # on the caller's event loop
            if done.cancelled():
                if cmd.undo is not None and error is None:
                    self.post(lambda engine: cmd.undo(engine, result))  # type: ignore[misc]
            elif error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        try:
            done.get_loop().call_soon_threadsafe(resolve)
        except RuntimeError:  # the caller's loop is closed: nobody will take the result
            if cmd.undo is not None and error is None:
                cmd.undo(self.engine, result)

    def _refuse_queued(self, error: RequestError) -> None:
        """Commands that came after the last step: nothing will run them now."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call) and cmd.done is not None:
                self._settle(cmd, None, error)
            elif isinstance(cmd, _Add):
                self._send(cmd, error)

    def _deliver(self, outputs: list[Output]) -> None:
        """Each request's outputs of this step into its queue: one wake-up per event loop, not per request
        (each call_soon_threadsafe writes to the loop's self-pipe; 32 streams made 32 syscalls a step)."""
        grouped: dict[str, list[Output]] = {}
        for out in outputs:
            grouped.setdefault(out.request_id, []).append(out)
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list]]] = {}
        for request_id, outs in grouped.items():
            add = self._sinks.get(request_id)
            if add is None:
                continue
            per_loop.setdefault(add.loop, []).append((add.sink, outs))
            add.unfinished -= sum(1 for o in outs if o.finish_reason is not None)
            if add.unfinished <= 0:
                del self._sinks[request_id]
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more

    def _fail_alone(self) -> None:
        """Requests the step failed one by one (already aborted in the engine)."""
        for request_id, error in self.engine.failed:
            add = self._sinks.pop(request_id, None)
            if add is not None:
                self._send(add, error)
        self.engine.failed.clear()

    def _fail_all(self, error: RequestError) -> None:
        for request_id, add in list(self._sinks.items()):
            self.engine.abort(request_id)
            self._send(add, error)
        self._sinks.clear()

    @staticmethod
    def _send(add: _Add, item: list[Output] | RequestError) -> None:
        try:
            add.loop.call_soon_threadsafe(add.sink.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed: nobody is listening any more


def _put_all(items: list[tuple[asyncio.Queue, list]]) -> None:
    for sink, outs in items:
        sink.put_nowait(outs)
