"""The port layout every role shares: what a process's START_PORT opens, and where its peers listen; and
free loopback ports for whatever starts roles (tests, benchmarks)."""
from __future__ import annotations

import random
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


def _ephemeral_range() -> tuple[int, int]:
    """The range the kernel hands outgoing connections their local ports from (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


_cursor: int | None = None  # where this process's next block search starts (a random place, then onward)


def free_port_block(span: int = 1, host: str = "127.0.0.1") -> int:
    """A port p such that p .. p+span-1 are all free on host right now (a role's START_PORT takes +0..+5).

    Blocks come from below the kernel's ephemeral range, so no client connection made meanwhile (an HTTP
    probe, a gRPC channel) can take one of them before the role binds it; successive calls in one process
    hand out disjoint blocks. Another process may still bind one first, as with any free-port pick."""
    global _cursor
    low, high = _ephemeral_range()
    if low - 10000 > span:
        first, last = 10000, low - span          # [first, last): below the ephemeral range
    else:
        first, last = high + 1, 65535 - span     # a system whose ephemeral range starts low
    if _cursor is None or not first <= _cursor < last:
        _cursor = random.randrange(first, last)
    for _ in range(400):
        base = _cursor
        _cursor = base + span if base + 2 * span < last else first
        if all(is_free(base + i, host) for i in range(span)):
            return base
    raise RuntimeError(f"no free block of {span} ports on {host}")
