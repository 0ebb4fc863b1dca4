"""The roles a kvyard process can play (ROLE_TYPE): one enum for every role's code and every wire."""
from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Named as ROLE_TYPE, the register body and WorkerStatusPB.role spell it (a Role equals its name as a
    string, so those wires need no table); `rtp_type` is RTP-LLM's RoleType number, which the master's
    /rtp_llm/schedule answer carries."""
    PDFUSION = "PDFUSION"          # backend (prefill + decode), with a frontend unless FRONTEND_SERVER_COUNT=0
    PREFILL = "PREFILL"            # prefill-only backend: hands each request's KV to a DECODE backend
    DECODE = "DECODE"              # decode-only backend
    FRONTEND = "FRONTEND"          # HTTP API only: tokenizer and templates, no weights
    MASTER = "MASTER"              # the cluster scheduler: routes each request to a backend (master/)
    MOCK_BACKEND = "MOCK_BACKEND"  # a gRPC backend with no model streaming scripted tokens (backend/mock_backend.py)
    MOCK_MASTER = "MOCK_MASTER"    # answers /rtp_llm/schedule with configured backends (master/mock_master.py)
    GATEWAY = "GATEWAY"            # HTTP proxy over OpenAI-compatible upstreams, queueing when all are busy (gateway/)
    VIT = "VIT"                    # a vision model's image tower and projector only: image files in, embeddings
                                   # out (backend/vit_server.py), for backends given VIT_ADDRESSES

    @property
    def rtp_type(self) -> int:
        return _RTP_TYPES[self]

    @property
    def is_backend(self) -> bool:
        """Runs an engine: reports worker status, takes GenerateStreamCall."""
        return self in BACKEND_ROLES


_RTP_TYPES = {Role.PDFUSION: 0, Role.PREFILL: 1, Role.DECODE: 2, Role.VIT: 3, Role.FRONTEND: 4, Role.MASTER: 5,
              Role.MOCK_BACKEND: 6, Role.MOCK_MASTER: 7, Role.GATEWAY: 8}
BACKEND_ROLES = frozenset({Role.PDFUSION, Role.PREFILL, Role.DECODE})


# RTP-LLM's RoleType numbers, as its ROLE_TYPE takes them.
RTP_ROLE_NUMBERS = {0: Role.PDFUSION, 1: Role.PREFILL, 2: Role.DECODE, 3: Role.VIT, 4: Role.FRONTEND}
# The roles the master tracks: backends it routes requests to, and VIT processes it only shows and polls.
WORKER_ROLES = BACKEND_ROLES | {Role.VIT}


def parse_role(value: str | None) -> Role:
    """A ROLE_TYPE name, any case, or RTP-LLM's RoleType number; unset means PDFUSION."""
    name = (value or "PDFUSION").strip().upper()
    if name.isdigit():
        if int(name) not in RTP_ROLE_NUMBERS:
            raise ValueError(f"unknown ROLE_TYPE {value!r}; RTP-LLM's numbers are "
                             f"{', '.join(f'{n} ({r.name})' for n, r in RTP_ROLE_NUMBERS.items())}")
        return RTP_ROLE_NUMBERS[int(name)]
    try:
        return Role[name]
    except KeyError:
        raise ValueError(f"unknown ROLE_TYPE {value!r}; one of: {', '.join(r.name for r in Role)} "
                         f"(or RTP-LLM's numbers 0, 1, 2, 3, 4)") from None
