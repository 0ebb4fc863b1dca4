"""MasterConfig: built once from the environment by the role launcher, then passed down."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvyard.cluster_auth import internal_token
from kvyard.env import INTERNAL_HOST, env_int, env_names, env_str
from kvyard.model_path import EMBEDDED_MODEL_NAME
from kvyard.ports import backend_http_for_grpc, start_port
from kvyard.roles import Role
from master.hold import HoldConfig
from master.policy import PolicyConfig



@dataclass(frozen=True)
class BackendEndpoint:
    """Where one backend is and what it serves."""
    host: str            # IP or host name
    grpc_port: int       # its START_PORT + 1
    http_port: int       # its START_PORT + 5
    model: str           # the model name clients ask for
    role: Role = Role.PDFUSION

    @property
    def name(self) -> str:
        return f"{self.host}:{self.grpc_port}"


@dataclass(frozen=True)
class DnsTarget:
    """A DNS name (a k8s headless Service) whose every address is a backend."""
    host: str
    grpc_port: int
    model: str


@dataclass(frozen=True)
class MasterConfig:
    host: str                              # bind address
    port: int                              # START_PORT: the master's HTTP port
    advertise_address: str                 # what POST /rtp_llm/master answers ("host:port")
    static_backends: tuple[BackendEndpoint, ...]  # MASTER_BACKENDS
    dns_targets: tuple[DnsTarget, ...]     # MASTER_BACKEND_DNS
    dns_interval_s: float                  # how often DNS names are re-resolved
    poll_interval_s: float                 # how often each backend's status is polled
    poll_timeout_s: float                  # one status RPC's deadline
    expire_s: float                        # a backend silent this long is out of routing
    forget_s: float                        # a self-registered backend silent this long is forgotten
    routed_grace_s: float                  # a routed request counts as load until a poll sent this long after it
    pending_keys_ttl_s: float              # keys of routed prompts count as cached there for this long
    working_set_s: float                   # ... and as its working set (the policy's recent_keys) this long
    policy: PolicyConfig                   # the routing knobs
    hold: HoldConfig = HoldConfig(256, 5.0)  # requests held while every backend is busy, and for how long
    cluster_token: str = ""                # CLUSTER_TOKEN(_FILE): internal calls must carry it; "" = open, no registration

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> MasterConfig:
        port = start_port(env)
        host = env_str(env, "HOST", INTERNAL_HOST)
        model = env_names(env, "MODEL_NAME", EMBEDDED_MODEL_NAME)[0]  # aliases are the frontends' business
        advertise = env_str(env, "ADVERTISE_HOST", "127.0.0.1" if host == "0.0.0.0" else host)
        expire_ms = env_int(env, "MASTER_EXPIRE_MS", 3000, minimum=100)
        return cls(
            host=host,
            port=port,
            advertise_address=f"{advertise}:{port}",
            static_backends=tuple(_endpoint(e, model, "MASTER_BACKENDS")
                                  for e in _items(env.get("MASTER_BACKENDS", ""))),
            dns_targets=tuple(_dns(e, model) for e in _items(env.get("MASTER_BACKEND_DNS", ""))),
            dns_interval_s=env_int(env, "MASTER_DNS_INTERVAL_S", 5, minimum=1),
            poll_interval_s=env_int(env, "MASTER_POLL_INTERVAL_MS", 150, minimum=10) / 1000,
            poll_timeout_s=env_int(env, "MASTER_POLL_TIMEOUT_MS", 1000, minimum=10) / 1000,
            expire_s=expire_ms / 1000,
            forget_s=env_int(env, "MASTER_FORGET_S", 60, minimum=1),
            routed_grace_s=env_int(env, "MASTER_ROUTED_GRACE_MS", 100, minimum=0) / 1000,
            pending_keys_ttl_s=env_int(env, "MASTER_PENDING_KEYS_TTL_MS", 5000, minimum=0) / 1000,
            working_set_s=env_int(env, "MASTER_WORKING_SET_MS", 30_000, minimum=0) / 1000,
            policy=PolicyConfig(
                default_prefill_tokens_per_s=float(env_int(env, "MASTER_DEFAULT_PREFILL_TPS", 2000, minimum=1)),
                max_waiting=env_int(env, "MASTER_MAX_WAITING", 64, minimum=1),
                imbalance_abs=env_int(env, "MASTER_IMBALANCE_ABS", 8, minimum=0),
                imbalance_ratio=env_int(env, "MASTER_IMBALANCE_PCT", 150, minimum=100) / 100,
                stickiness=env_int(env, "MASTER_STICKINESS_PCT", 100, minimum=0) / 100,
            ),
            hold=HoldConfig(max_waiting=env_int(env, "MASTER_QUEUE_MAX", 256, minimum=0),
                            wait_s=env_int(env, "MASTER_QUEUE_WAIT_MS", 5000, minimum=0) / 1000),
            cluster_token=internal_token(env, host),
        )


def _items(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def _split_model(item: str, default_model: str) -> tuple[str, str]:
    """`model@host:port` or `host:port`."""
    model, sep, rest = item.rpartition("@")
    return (model, rest) if sep and model else (default_model, rest if sep else item)


def _host_port(address: str, what: str, item: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} entries are [model@]host:grpc_port, got {item!r}")
    return host.strip("[]"), int(port)


def _endpoint(item: str, default_model: str, what: str) -> BackendEndpoint:
    model, address = _split_model(item, default_model)
    host, port = _host_port(address, what, item)
    return BackendEndpoint(host, port, backend_http_for_grpc(port), model)


def _dns(item: str, default_model: str) -> DnsTarget:
    model, address = _split_model(item, default_model)
    host, port = _host_port(address, "MASTER_BACKEND_DNS", item)
    return DnsTarget(host, port, model)
