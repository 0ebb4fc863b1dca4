"""The cluster token end to end: read once per role (CLUSTER_TOKEN or a file), refused weak or missing
where a port opens to the network; gRPC callers without it get UNAUTHENTICATED (health stays open); the
frontend, master poller and prefill → decode channel carry it; the launcher makes one for PDFUSION; the
frontend's pool to the master holds CONCURRENCY_LIMIT connections."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from typing import Any

import grpc
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc

from backend.config import BackendConfig
from backend.mock_backend import MockBackendConfig, MockScript, MockServicer, ScriptedEngine, start_mock_server
from backend.pd_transfer import DecodeChannels
from frontend.backend_client import BackendClient
from kvyard.sampling_params import SamplingParams
from frontend.config import FrontendConfig
from frontend.routing import Router
from kvyard.cluster_auth import read_cluster_token
from kvyard.errors import RequestError
from launcher.launch import with_cluster_token
from kvyard.roles import Role
from master.backend_poller import BackendPoller, StatusError
from master.config import MasterConfig
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from tests.support.procs import free_port_block
from tests.support.app_thread import AppThread

TOKEN = "cluster-secret-for-tests-0123"


# ---- configuration ----------------------------------------------------------------------------

def test_token_from_env_or_file(tmp_path: Path) -> None:
    assert read_cluster_token({}) == ""
    assert read_cluster_token({"CLUSTER_TOKEN": TOKEN}) == TOKEN
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")  # a mounted Secret or `echo` leaves a newline
    assert read_cluster_token({"CLUSTER_TOKEN_FILE": str(secret)}) == TOKEN
    assert FrontendConfig.from_env({"CLUSTER_TOKEN_FILE": str(secret)}).cluster_token == TOKEN
    assert MasterConfig.from_env({"CLUSTER_TOKEN": TOKEN}).cluster_token == TOKEN
    assert BackendConfig.from_env({"DEVICE": "cpu", "CLUSTER_TOKEN": TOKEN}).cluster_token == TOKEN


@pytest.mark.parametrize("env, needle", [
    ({"CLUSTER_TOKEN": "short"}, "at least 16"),
    ({"CLUSTER_TOKEN": "has a space in it, sixteen+"}, "printable ASCII"),
    ({"CLUSTER_TOKEN": TOKEN, "CLUSTER_TOKEN_FILE": "/x"}, "not both"),
    ({"CLUSTER_TOKEN_FILE": "/does/not/exist"}, "/does/not/exist"),
])
def test_bad_tokens_are_refused(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        read_cluster_token(env)


def test_an_open_bind_needs_a_token() -> None:
    for build in (lambda e: MasterConfig.from_env(e), lambda e: BackendConfig.from_env({"DEVICE": "cpu", **e}),
                  lambda e: MockBackendConfig.from_env({"MOCK_TOKEN_IDS": "5,2", **e})):
        with pytest.raises(ValueError, match="CLUSTER_TOKEN"):
            build({"HOST": "0.0.0.0"})
        assert build({"HOST": "0.0.0.0", "CLUSTER_TOKEN": TOKEN}).host == "0.0.0.0"
        assert build({}).host == "127.0.0.1"  # the default: loopback, no token needed
    assert MasterConfig.from_env({"HOST": "::1"}).cluster_token == ""


def test_launcher_generates_a_token_for_pdfusion_only() -> None:
    first = with_cluster_token(Role.PDFUSION, {})["CLUSTER_TOKEN"]
    second = with_cluster_token(Role.PDFUSION, {})["CLUSTER_TOKEN"]
    assert len(first) >= 32 and first != second and read_cluster_token({"CLUSTER_TOKEN": first}) == first
    assert with_cluster_token(Role.PDFUSION, {"CLUSTER_TOKEN": TOKEN})["CLUSTER_TOKEN"] == TOKEN
    assert "CLUSTER_TOKEN" not in with_cluster_token(Role.PDFUSION, {"CLUSTER_TOKEN_FILE": "/run/t"})
    # A lone backend or master is called by processes it did not start: a made-up token would lock them out.
    assert with_cluster_token(Role.PDFUSION, {"FRONTEND_SERVER_COUNT": "0"}) == {"FRONTEND_SERVER_COUNT": "0"}
    for role in (Role.MASTER, Role.PREFILL, Role.DECODE, Role.FRONTEND):
        assert with_cluster_token(role, {}) == {}


# ---- gRPC ---------------------------------------------------------------------------------------

async def _mock_backend(token: str) -> tuple[grpc.aio.Server, str]:
    port = free_port_block(1)
    server = await start_mock_server(MockServicer(ScriptedEngine(MockScript((5, 6, 2)))), "127.0.0.1", port, token)
    return server, f"127.0.0.1:{port}"


def _generate(stub: pb_grpc.ModelRpcServiceStub, metadata: tuple[tuple[str, str], ...]) -> AsyncIterator:
    msg = pb.GenerateInputPB(request_id="r", token_ids=[1, 2, 3], generate_config=pb.GenerateConfigPB(max_new_tokens=3))
    return stub.GenerateStreamCall(msg, metadata=metadata)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer cluster-secret-for-tests-0124"),),
                                      (("authorization", TOKEN),)], ids=["none", "wrong", "no-bearer"])
def test_grpc_without_the_token_is_unauthenticated(metadata: tuple[tuple[str, str], ...]) -> None:
    async def go() -> None:
        server, address = await _mock_backend(TOKEN)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.ModelRpcServiceStub(channel)
                for call in (lambda: stub.GetWorkerStatus(pb.WorkerStatusRequestPB(), metadata=metadata),
                             lambda: _collect(_generate(stub, metadata))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "cluster token" in (err.value.details() or "")
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        finally:
            await server.stop(0)

    asyncio.run(go())


async def _collect(call: AsyncIterator) -> list:
    return [out async for out in call]


def test_grpc_clients_carry_the_token() -> None:
    """The frontend's client, the master's poller and the prefill → decode channel all get through;
    without the token the same clients are refused."""
    async def go() -> None:
        server, address = await _mock_backend(TOKEN)
        try:
            client = BackendClient(address, TOKEN)
            outs = [o async for step in client.generate("r1", [1, 2, 3], SamplingParams(max_new_tokens=3))
                    for o in step]
            assert [t for o in outs for t in o.token_ids] == [5, 6, 2]
            await client.close()
            poller = BackendPoller(address, 10.0, TOKEN)
            assert (await poller.worker_status()).alive
            await poller.close()
            decode = DecodeChannels(TOKEN).stub(address)  # the channel interceptor adds the metadata
            assert (await decode.GetWorkerStatus(pb.WorkerStatusRequestPB())).alive
            assert len(await _collect(_generate(decode, ()))) == 3
            for stub, code in ((decode, grpc.StatusCode.UNIMPLEMENTED),  # the mock has no RemoteDecode: it got in
                               (pb_grpc.ModelRpcServiceStub(grpc.aio.insecure_channel(address)),
                                grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.aio.AioRpcError) as rpc_err:
                    await _collect(stub.RemoteDecode(iter([pb.KVTransferPB()])))
                assert rpc_err.value.code() == code

            anonymous = BackendClient(address)
            with pytest.raises(RequestError, match="UNAUTHENTICATED"):
                async for _ in anonymous.generate("r2", [1, 2, 3], SamplingParams(max_new_tokens=3)):
                    pass
            await anonymous.close()
            poller = BackendPoller(address, 10.0)
            with pytest.raises(StatusError, match="UNAUTHENTICATED") as err:
                await poller.worker_status()
            assert err.value.definitive  # out of routing: it will never answer us
            await poller.close()
        finally:
            await server.stop(0)

    asyncio.run(go())


# ---- frontend → master ------------------------------------------------------------------------

def _slow_master(delay_s: float, in_flight: list[int]) -> FastAPI:
    """Answers every schedule after delay_s; in_flight[0] counts calls now open, in_flight[1] the most seen."""
    app = FastAPI()

    @app.post("/rtp_llm/schedule")
    async def schedule() -> dict[str, Any]:
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(delay_s)
        finally:
            in_flight[0] -= 1
        return {"server_status": [{"role": 0, "server_ip": "10.0.0.9", "grpc_port": 8089, "http_port": 8093,
                                   "debug_info": {"hit_cache_len": 0}}]}

    return app


def test_frontend_pool_to_the_master_holds_the_admission_limit() -> None:
    """Every admitted request can ask the master at once: httpx's default pool of 100 connections queued the
    rest, and under 256 concurrent requests the queued ones timed out and were routed blind."""
    in_flight = [0, 0]
    with AppThread(_slow_master(3.0, in_flight)) as master:
        cfg = FrontendConfig.from_env({"MASTER_ADDRESS": master.url.removeprefix("http://"),
                                       "BACKEND_ADDRESSES": "127.0.0.1:1", "MAX_SEQ_LEN": "512",
                                       "MASTER_TIMEOUT_MS": "10000", "CONCURRENCY_LIMIT": "150",
                                       "CLUSTER_TOKEN": TOKEN})

        async def go() -> list[bool]:
            router = Router(cfg)
            try:
                routes = await asyncio.gather(*(router.route("m", [1, 2, 3]) for _ in range(150)))
            finally:
                await router.close()
            return [r.via_master for r in routes]

        assert all(asyncio.run(go()))
    assert in_flight[1] == 150, in_flight


def test_frontend_sends_the_token_to_the_master_and_a_refusal_is_not_the_clients_fault() -> None:
    headers: list[str] = []
    app = FastAPI()

    @app.post("/rtp_llm/schedule")
    async def refuse(request: Request) -> JSONResponse:
        headers.append(request.headers.get("authorization", ""))
        return JSONResponse({"error": {"message": "wrong cluster token", "type": "authentication_error",
                                       "param": None, "code": "invalid_api_key"}}, 401)

    with AppThread(app) as master:
        cfg = FrontendConfig.from_env({"MASTER_ADDRESS": master.url.removeprefix("http://"),
                                       "BACKEND_ADDRESSES": "127.0.0.1:1", "MAX_SEQ_LEN": "512",
                                       "CLUSTER_TOKEN": TOKEN})

        async def go() -> bool:
            router = Router(cfg)
            try:
                return (await router.route("m", [1, 2, 3])).via_master
            finally:
                await router.close()

        assert asyncio.run(go()) is False  # the direct list, and a warning in the log; never a 401 to the client
    assert headers == [f"Bearer {TOKEN}"]
