"""The port layout every role shares: what a process's START_PORT opens, and where its peers listen."""
from __future__ import annotations

from collections.abc import Mapping

from kvyard.env import env_int

DEFAULT_START_PORT = 8088
BACKEND_GRPC_OFFSET = 1  # a backend's gRPC port: START_PORT + 1 (a frontend beside it finds it there)
BACKEND_HTTP_OFFSET = 5  # a backend's HTTP port (load reports, /metrics): START_PORT + 5


def start_port(env: Mapping[str, str]) -> int:
    """START_PORT: a frontend's or master's HTTP port, the base of a backend's ports."""
    return env_int(env, "START_PORT", DEFAULT_START_PORT, minimum=1)


def backend_grpc_port(start: int) -> int:
    return start + BACKEND_GRPC_OFFSET


def backend_http_port(start: int) -> int:
    return start + BACKEND_HTTP_OFFSET


def backend_http_for_grpc(grpc_port: int) -> int:
    """A backend's HTTP port known only by its gRPC port (a static list, a DNS name)."""
    return grpc_port - BACKEND_GRPC_OFFSET + BACKEND_HTTP_OFFSET
