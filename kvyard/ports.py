"""The port layout every role shares: what a process's START_PORT opens, and where its peers listen; and
free loopback ports for whatever starts roles (tests, benchmarks)."""
from __future__ import annotations

import socket
from collections.abc import Mapping

from kvyard.env import env_int

DEFAULT_START_PORT = 8088
BACKEND_GRPC_OFFSET = 1  # a backend's gRPC port: START_PORT + 1 (a frontend beside it finds it there)
BACKEND_HTTP_OFFSET = 5  # a backend's HTTP port (load reports, /metrics): START_PORT + 5


EMBEDDING_OFFSET = 10    # PDFUSION's embedding backend (EMBEDDING_MODEL_PATH): its START_PORT is START_PORT + 10


def embedding_start_port(start: int) -> int:
    return start + EMBEDDING_OFFSET


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


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether port can be bound on host right now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(span: int = 1, host: str = "127.0.0.1") -> int:
    """A port p such that p .. p+span-1 are all free on host right now (a role's START_PORT takes +0..+5;
    whoever binds them later may still lose a race, as with any free-port pick)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + span < 65535 and all(is_free(base + i, host) for i in range(span)):
            return base
    raise RuntimeError(f"no free block of {span} ports on {host}")
