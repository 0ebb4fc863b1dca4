"""ROLE_TYPE=MOCK_BACKEND: the backend's gRPC surface with no model. Every request streams the same scripted
token ids, one per step, for each of its sequences, so a frontend's templates, stop strings, detokenizing
and tool-call parsing can be debugged in seconds with no weights loaded.

The script comes from MOCK_TOKEN_IDS (a JSON list), MOCK_TOKEN_FILE (a file of ids: a JSON list or ids
separated by whitespace/commas) or MOCK_TEXT (encoded with TOKENIZER_PATH's tokenizer, eos appended).
MOCK_DELAY_MS waits before each token; MOCK_ERROR=<kind>[@<tokens>] fails every request after that many
tokens (0 = before the first) with one of ErrorCodePB's names, or UNAVAILABLE (the call itself aborts).
A script that ends finishes with "stop"; max_new_tokens reached first finishes with "length".
Logprobs are made up but fixed per token id (mock_logprob); ScoreCall answers with the same numbers.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from backend.grpc_server import start_grpc_server

from kvyard.cluster_auth import internal_token
from kvyard.env import INTERNAL_HOST, env_int, env_str
from kvyard.ports import backend_grpc_port, start_port
from kvyard.roles import Role
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.mock_backend")

MOCK_TOTAL_BLOCKS = 1024  # what GetWorkerStatus reports; each running sequence holds one block


def mock_logprob(token_id: int) -> float:
    return -0.25 * (token_id % 7) - 0.125


@dataclass(frozen=True)
class MockScript:
    token_ids: tuple[int, ...]           # streamed one per step, for every sequence of every request
    delay_s: float = 0.0                 # before each token
    error: str | None = None             # an ErrorCodePB name, or "UNAVAILABLE" (abort the gRPC call)
    error_after: int = 0                 # tokens streamed before the error

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MockScript:
        ids = _script_ids(env)
        error, after = None, 0
        raw = env.get("MOCK_ERROR", "")
        if raw:
            name, _, count = raw.partition("@")
            error = name.strip().upper()
            if error != "UNAVAILABLE" and error not in pb.ErrorCodePB.keys():
                raise ValueError(f"MOCK_ERROR must be one of {', '.join(pb.ErrorCodePB.keys()[1:])} or "
                                 f"UNAVAILABLE, optionally @<tokens>; got {raw!r}")
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


class MockServicer(pb_grpc.ModelRpcServiceServicer):
    """Reads `script` on every call, so a test can swap it between requests."""

    def __init__(self, script: MockScript) -> None:
        self.script = script
        self.requests: list[pb.GenerateInputPB] = []   # every request received, in order
        self.cancelled = 0                              # calls the client cancelled mid-stream
        self.running = 0                                # sequences streaming now

    async def GenerateStreamCall(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        script, cfg = self.script, request.generate_config
        n = max(1, cfg.num_return_sequences)
        steps = min(len(script.token_ids), cfg.max_new_tokens or len(script.token_ids))
        self.running += n
        try:
            for i in range(steps):
                if script.error is not None and i == script.error_after:
                    yield await self._failure(request, context, script.error)
                    return
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                out = pb.GenerateOutputsPB(request_id=request.request_id)
                token = script.token_ids[i]
                last = i == steps - 1
                reason = pb.FINISH_REASON_STOP if i == len(script.token_ids) - 1 else pb.FINISH_REASON_LENGTH
                for seq in range(n):
                    o = out.generate_outputs.add(
                        index=seq, output_ids=[token], finished=last,
                        finish_reason=reason if last else pb.FINISH_REASON_UNSPECIFIED,
                        aux_info=pb.AuxInfoPB(input_len=len(request.token_ids), output_len=i + 1,
                                              iter_count=i + 1, cost_time_us=int((i + 1) * script.delay_s * 1e6)))
                    if cfg.return_logprobs:
                        lp = o.logprobs.add(token_id=token, logprob=mock_logprob(token))
                        for k in range(cfg.top_logprobs):
                            alt = token if k == 0 else token + k
                            lp.top_logprobs.add(token_id=alt, logprob=mock_logprob(token) - k)
                yield out
            if script.error is not None and script.error_after >= steps:
                yield await self._failure(request, context, script.error)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= n

    async def _failure(self, request: pb.GenerateInputPB, context: grpc.aio.ServicerContext,
                       error: str) -> pb.GenerateOutputsPB:
        if error == "UNAVAILABLE":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "mock backend: scripted failure")
        return pb.GenerateOutputsPB(request_id=request.request_id, error=pb.ErrorDetailsPB(
            code=pb.ErrorCodePB.Value(error), message=f"mock backend: scripted {error}"))

    async def ScoreCall(self, request: pb.ScoreInputPB, context: grpc.aio.ServicerContext) -> pb.ScoreOutputPB:
        out = pb.ScoreOutputPB(aux_info=pb.AuxInfoPB(input_len=len(request.prompt_ids) + len(request.scored_ids)))
        for token in request.scored_ids:
            lp = out.logprobs.add(token_id=token, logprob=mock_logprob(token))
            for k in range(request.top_logprobs):
                lp.top_logprobs.add(token_id=token + k, logprob=mock_logprob(token) - k)
        return out

    async def GetWorkerStatus(self, request: pb.WorkerStatusRequestPB,
                              context: grpc.aio.ServicerContext) -> pb.WorkerStatusPB:
        return pb.WorkerStatusPB(role=Role.PDFUSION, running=self.running, free_blocks=MOCK_TOTAL_BLOCKS - self.running,
                                 total_blocks=MOCK_TOTAL_BLOCKS, block_size=16, step_latency_ms=1.0,
                                 prefill_tokens_per_s=1e6, alive=True, version=len(self.requests))

    async def GetCacheStatus(self, request: pb.CacheStatusRequestPB,
                             context: grpc.aio.ServicerContext) -> pb.CacheStatusPB:
        return pb.CacheStatusPB(version=0, is_diff=False, block_size=16)


async def start_mock_server(servicer: MockServicer, host: str, port: int, token: str = "") -> grpc.aio.Server:
    server, _ = await start_grpc_server(servicer, host, port, token)  # the real backend's set-up, health, auth
    return server


@dataclass(frozen=True)
class MockBackendConfig:
    host: str            # bind address
    grpc_port: int       # START_PORT + 1, where a frontend looks for its backend
    script: MockScript
    cluster_token: str = ""  # CLUSTER_TOKEN(_FILE): callers must carry it, as with the real backend

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MockBackendConfig:
        start = start_port(env)
        host = env_str(env, "HOST", INTERNAL_HOST)
        return cls(host, backend_grpc_port(start), MockScript.from_env(env), internal_token(env, host))


async def serve_mock_backend(cfg: MockBackendConfig) -> None:
    server = await start_mock_server(MockServicer(cfg.script), cfg.host, cfg.grpc_port, cfg.cluster_token)
    log.info("mock backend on %s:%d: %d scripted tokens, %.0f ms apart%s", cfg.host, cfg.grpc_port,
             len(cfg.script.token_ids), cfg.script.delay_s * 1000,
             f", failing with {cfg.script.error} after {cfg.script.error_after}" if cfg.script.error else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
