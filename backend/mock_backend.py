"""ROLE_TYPE=MOCK_BACKEND: the real backend's gRPC servicer (backend/server.py) over a scripted engine, no
model. Every request streams the same scripted token ids, one per step, for each of its sequences, so a
frontend's templates, stop strings, detokenizing and tool-call parsing can be debugged in seconds with no
weights loaded; requests are parsed, checked and answered exactly as the real backend does.

The script comes from MOCK_TOKEN_IDS (a JSON list), MOCK_TOKEN_FILE (a file of ids: a JSON list or ids
separated by whitespace/commas) or MOCK_TEXT (encoded with TOKENIZER_PATH's tokenizer, eos appended).
MOCK_DELAY_MS waits before each token; MOCK_ERROR=<kind>[@<tokens>] fails every request after that many
tokens (0 = before the first) with one of ErrorCodePB's names, answered as the real backend answers errors.
A script that ends finishes with "stop" (its end stands for an eos), unless the request sets ignore_eos: then
its last token repeats until max_new_tokens; max_new_tokens reached first finishes with "length" (0 means up
to the context, as in the real backend); stop token ids and stop sequences end a sequence where the engine would.
Logprobs are made up but fixed per token id (mock_logprob); ScoreCall answers with the same numbers.
Constraints (guided decoding) are taken but not enforced, and PD hand-overs (RemoteDecode) are not mocked.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import signal
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn

from backend.debug_views import BackendFacts
from backend.engine_types import (CacheStatus, GenerationRequest, PoolingRequest, PoolingResult, ScoreRequest,
                                  ScoreResult, TokenOutput)
from backend.grpc_server import start_grpc_server
from backend.http_server import create_backend_http_app
from backend.sampler import Sample
from kvyard.sampling_params import SamplingParams
from backend.sequence import FinishReason, Sequence
from backend.server import ModelRpcServicer
from backend.validation import check_token_ids

from kvyard.aux_info import AuxInfo
from kvyard.cluster_auth import internal_token
from kvyard.constraint import Constraint
from kvyard.env import INTERNAL_HOST, env_int, env_str
from kvyard.errors import ErrorCode, RequestError
from kvyard.pb_errors import error_from_pb
from kvyard.metrics import BackendMetrics
from kvyard.ports import backend_grpc_port, backend_http_port, start_port
from kvyard.roles import Role
from kvyard.worker_status import WorkerStatus
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.mock_backend")

MOCK_TOTAL_BLOCKS = 1024  # what GetWorkerStatus reports; each running sequence holds one block
MOCK_MAX_MODEL_LEN = 1 << 20  # the context the servicer checks against: no script comes near it


def mock_logprob(token_id: int) -> float:
    return -0.25 * (token_id % 7) - 0.125


@dataclass(frozen=True)
class MockScript:
    token_ids: tuple[int, ...]           # streamed one per step, for every sequence of every request
    delay_s: float = 0.0                 # before each token
    error: str | None = None             # an ErrorCodePB name
    error_after: int = 0                 # tokens streamed before the error
    error_message: str | None = None     # what the error says (default: "mock backend: scripted <kind>")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MockScript:
        ids = _script_ids(env)
        error, after = None, 0
        raw = env.get("MOCK_ERROR", "")
        if raw:
            name, _, count = raw.partition("@")
            error = name.strip().upper()
            if error not in pb.ErrorCodePB.keys()[1:]:
                raise ValueError(f"MOCK_ERROR must be one of {', '.join(pb.ErrorCodePB.keys()[1:])}, "
                                 f"optionally @<tokens>; got {raw!r}")
            if count and not count.isdigit():
                raise ValueError(f"MOCK_ERROR's @<tokens> must be a number, got {raw!r}")
            after = int(count or 0)
        return cls(ids, env_int(env, "MOCK_DELAY_MS", 0, minimum=0) / 1000, error, after)


def _script_ids(env: Mapping[str, str]) -> tuple[int, ...]:
    if env.get("MOCK_TOKEN_IDS"):
        ids = _parse_ids(env["MOCK_TOKEN_IDS"], "MOCK_TOKEN_IDS")
    elif env.get("MOCK_TOKEN_FILE"):
        path = Path(env["MOCK_TOKEN_FILE"])
        if not path.is_file():
            raise ValueError(f"MOCK_TOKEN_FILE {path} does not exist")
        ids = _parse_ids(path.read_text(), f"MOCK_TOKEN_FILE {path}")
    elif env.get("MOCK_TEXT"):
        from kvyard.model_path import resolve_model_path
        from kvyard.tokenizer import TextTokenizer
        tok = TextTokenizer.from_path(resolve_model_path(env.get("TOKENIZER_PATH") or env.get("CHECKPOINT_PATH")))
        ids = tok.encode(env["MOCK_TEXT"], parse_special=True)
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    else:
        raise ValueError("the mock backend needs a script: set MOCK_TOKEN_IDS, MOCK_TOKEN_FILE or MOCK_TEXT")
    if not ids or any(i < 0 for i in ids):
        raise ValueError("the mock backend's script must be non-empty, non-negative token ids")
    return tuple(ids)


def _parse_ids(text: str, where: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [int(t) for t in re.split(r"[\s,]+", text.strip()) if t] if re.fullmatch(r"[\d\s,]+", text) else None
    if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
        raise ValueError(f"{where} must be a JSON list of token ids (or ids separated by spaces)")
    return value


class ScriptedEngine:
    """What ModelRpcServicer calls on its EngineLoop (generate, score, worker_status, cache_status), answered
    from a MockScript instead of a model. The real servicer sits in front, so request parsing, defaults
    (max_new_tokens=0 means up to the context), errors and protobuf encoding are the real backend's.

    Each sequence takes the script's tokens in order and stops where the engine would stop it (stop token ids,
    stop sequences, max_new_tokens → "length"); a script that runs out finishes with "stop", like an eos.
    Reads `script` on every request, so a test can swap it between requests. With a vocab_size, token ids
    outside it are refused as the engine refuses them. Tests choose a script per request through script_for
    (tests/support/stub_backend.py)."""

    alive = True

    def __init__(self, script: MockScript, vocab_size: int | None = None) -> None:
        self.script = script
        self.vocab_size = vocab_size
        self.generation_requests: list[GenerationRequest] = []  # as the servicer handed them over
        self.cancelled = 0                      # requests whose caller left mid-stream
        self.cancelled_ids: list[str] = []
        self.running = 0                        # sequences streaming now

    def script_for(self, req: GenerationRequest) -> MockScript:
        """What this request streams."""
        return self.script

    def _check_ids(self, ids: list[int]) -> None:
        if self.vocab_size is not None:
            check_token_ids(ids, self.vocab_size)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenOutput]]:
        self.generation_requests.append(req)
        self._check_ids(req.prompt_ids)
        if req.sampling.adapter:
            raise RequestError(ErrorCode.MODEL_NOT_FOUND, f"the LoRA adapter {req.sampling.adapter!r} is not loaded: "
                               "the mock backend holds no adapters", "model")
        script = self.script_for(req)
        seqs = [Sequence(req.request_id, req.prompt_ids, req.stop, index=i) for i in range(req.n)]
        self.running += req.n
        steps = 0
        try:
            for step, token in enumerate(_steps(script.token_ids, req)):
                if script.error is not None and step == script.error_after:
                    raise _scripted_error(script)
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                aux = AuxInfo(input_len=len(req.prompt_ids), output_len=step + 1, iter_count=step + 1, reuse_len=0,
                              cost_time_us=int((step + 1) * script.delay_s * 1e6), first_token_cost_time_us=0,
                              wait_time_us=0)
                outs = []
                for seq in seqs:
                    seq.append_token(token)
                    reason = seq.check_stop()
                    if reason is None and step == len(script.token_ids) - 1 and not req.stop.ignore_eos:
                        reason = FinishReason.STOP  # the script ran out: its end stands for an eos
                    outs.append(TokenOutput(req.request_id, seq.index, token, _sample(token, req.sampling), reason,
                                            aux))
                steps += 1
                yield outs
                if all(out.finish_reason is not None for out in outs):
                    break
            if script.error is not None and script.error_after >= steps:
                raise _scripted_error(script)
        except (asyncio.CancelledError, GeneratorExit):  # at an await, or closed at a yield: the caller left
            self.cancelled += 1
            self.cancelled_ids.append(req.request_id)
            raise
        finally:
            self.running -= req.n

    async def score(self, req: ScoreRequest) -> ScoreResult:
        self._check_ids([*req.prompt_ids, *req.scored_ids])
        samples = [Sample(t, mock_logprob(t), [(t + k, mock_logprob(t) - k) for k in range(req.top_logprobs)] or None)
                   for t in req.scored_ids]
        return ScoreResult(req.request_id, samples, AuxInfo(len(req.prompt_ids) + len(req.scored_ids), 0, 0, 0, 0, 0, 0))

    @functools.cached_property
    def metrics(self) -> BackendMetrics:
        """What the backend HTTP app's /metrics serves (made when the mock serves HTTP)."""
        return BackendMetrics(self.worker_status, "mock")

    async def pool(self, req: PoolingRequest) -> PoolingResult:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "the mock backend serves a generate model: it has no pooling",
                           "model")

    def worker_status(self) -> WorkerStatus:
        return WorkerStatus(role=Role.PDFUSION, running=self.running, waiting=0, queued_prefill_tokens=0,
                            step_latency_ms=1.0, prefill_tokens_per_s=1e6, free_blocks=MOCK_TOTAL_BLOCKS - self.running,
                            total_blocks=MOCK_TOTAL_BLOCKS, block_size=16, version=len(self.generation_requests),
                            iterate_count=0, alive=True, cache_version=0)

    def cache_status(self, since_version: int) -> CacheStatus:
        return CacheStatus(version=0, is_diff=False, cached_keys=[], added_keys=[], removed_keys=[], block_size=16)


def _steps(ids: tuple[int, ...], req: GenerationRequest) -> Iterator[int]:
    """The script, then (ignore_eos: its end is no eos) its last token until max_new_tokens."""
    yield from ids
    if req.stop.ignore_eos:
        for _ in range(req.stop.max_new_tokens - len(ids)):
            yield ids[-1]


def _sample(token: int, sampling: SamplingParams) -> Sample:
    if not sampling.logprobs:
        return Sample(token, None, None)
    top = [(token if k == 0 else token + k, mock_logprob(token) - k) for k in range(sampling.top_logprobs)]
    return Sample(token, mock_logprob(token), top or None)


def _scripted_error(script: MockScript) -> RequestError:
    assert script.error is not None
    error = error_from_pb(pb.ErrorDetailsPB(code=pb.ErrorCodePB.Value(script.error)))
    return RequestError(error.code, script.error_message or f"mock backend: scripted {script.error}")


class _UncheckedGrammars:
    """Takes every constraint and masks nothing: a script is fixed, whatever grammar the request asks for."""

    async def compile(self, constraint: Constraint) -> None:
        return None


class MockServicer(ModelRpcServicer):
    """The real servicer over a ScriptedEngine; it also keeps every GenerateStreamCall request as received."""

    def __init__(self, engine: ScriptedEngine, max_model_len: int = MOCK_MAX_MODEL_LEN) -> None:
        self.engine = engine
        super().__init__(self.engine, frozenset(), max_model_len,  # type: ignore[arg-type]  # EngineLoop-shaped
                         grammars=_UncheckedGrammars())  # type: ignore[arg-type]
        self.requests: list[pb.GenerateInputPB] = []   # every request received, in order

    async def GenerateStreamCall(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        stream = super().GenerateStreamCall(request, context)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    # A scripted engine holds no KV to hand over: PD hand-overs are not mocked (UNIMPLEMENTED).
    RemoteDecode = pb_grpc.ModelRpcServiceServicer.RemoteDecode

    # What tests read and set, kept on the engine.
    @property
    def script(self) -> MockScript:
        return self.engine.script

    @script.setter
    def script(self, script: MockScript) -> None:
        self.engine.script = script

    @property
    def cancelled(self) -> int:
        return self.engine.cancelled

    @property
    def running(self) -> int:
        return self.engine.running


async def start_mock_server(servicer: MockServicer, host: str, port: int, token: str = "") -> grpc.aio.Server:
    server, _ = await start_grpc_server(servicer, host, port, token)  # the real backend's set-up, health, auth
    return server


@dataclass(frozen=True)
class MockBackendConfig:
    host: str            # bind address
    grpc_port: int       # START_PORT + 1, where a frontend looks for its backend
    script: MockScript
    cluster_token: str = ""  # CLUSTER_TOKEN(_FILE): callers must carry it, as with the real backend
    http_port: int = 0   # START_PORT + 5: the backend's HTTP app (health, /worker_status, /cache_status); 0 = none

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MockBackendConfig:
        start = start_port(env)
        host = env_str(env, "HOST", INTERNAL_HOST)
        return cls(host, backend_grpc_port(start), MockScript.from_env(env), internal_token(env, host),
                   backend_http_port(start))


async def serve_mock_backend(cfg: MockBackendConfig) -> None:
    servicer = MockServicer(ScriptedEngine(cfg.script))
    server = await start_mock_server(servicer, cfg.host, cfg.grpc_port, cfg.cluster_token)
    http: uvicorn.Server | None = None
    serving: asyncio.Task[None] | None = None
    if cfg.http_port:
        facts = BackendFacts(cfg.grpc_port - 1, cfg.grpc_port, cfg.http_port, MOCK_TOTAL_BLOCKS)
        app = create_backend_http_app(servicer.engine, cfg.cluster_token, servicer.tasks, facts)  # type: ignore[arg-type]
        http = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_level="warning",
                                             access_log=False))
        http.install_signal_handlers = lambda: None  # this function owns the signals
        serving = asyncio.create_task(http.serve())
    log.info("mock backend on %s:%d: %d scripted tokens, %.0f ms apart%s", cfg.host, cfg.grpc_port,
             len(cfg.script.token_ids), cfg.script.delay_s * 1000,
             f", failing with {cfg.script.error} after {cfg.script.error_after}" if cfg.script.error else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    if http is not None and serving is not None:
        http.should_exit = True
        await serving
