"""The backend's gRPC server set-up and health, shared by the real backend and the mock backend."""
from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvyard.cluster_auth import server_interceptors
from kvyard.grpc_keepalive import SERVER_OPTIONS
from backend.rtp_rpc import RtpRpcServicer
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.backend")

SERVICE_NAME = "kvyard.ModelRpcService"


async def start_grpc_server(servicer: pb_grpc.ModelRpcServiceServicer, host: str, port: int, token: str = ""
                            ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """token: the cluster token every RPC but the health service must carry ("" = open)."""
    server = grpc.aio.server(interceptors=server_interceptors(token), options=[
        ("grpc.max_send_message_length", 256 * 1024 * 1024),
        ("grpc.max_receive_message_length", 256 * 1024 * 1024),
        ("grpc.so_reuseport", 0),
        *SERVER_OPTIONS,
    ])
    pb_grpc.add_ModelRpcServiceServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([RtpRpcServicer(servicer).handler()])  # RTP-LLM's GenerateStreamCall
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the backend gRPC port {host}:{port}")
    await server.start()
    await set_serving(health_servicer, True)
    log.info("backend gRPC serving on %s:%d", host, port)
    return server, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)
