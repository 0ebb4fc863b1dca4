"""GatewayConfig: built once from the environment by the role launcher, then passed down.

The first six names are text-inference-batcher's, with its defaults; the GATEWAY_* ones are kvyard's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvyard.env import env_choice, env_int, env_str
from master.policy import PolicyConfig

DEFAULT_PORT = 8000
ROUTING_PREFIX = "prefix"                   # the master's policy over an approximate prefix tree
ROUTING_LEAST_CONNECTION = "least_connection"  # the seed's algorithm alone


@dataclass(frozen=True)
class GatewayConfig:
    upstreams: tuple[str, ...]       # UPSTREAMS: base URLs (scheme://host:port[/path]), no trailing /v1
    max_connect_per_upstream: int    # MAX_CONNECT_PER_UPSTREAM: requests in flight per upstream
    wait_for_s: float                # WAIT_FOR (ms): longest a request waits for a free upstream → 429
    timeout_s: float                 # TIMEOUT (ms): one upstream exchange, dispatch to last byte → 504
    debug: bool                      # DEBUG: verbose logging
    host: str                        # HOST: bind address
    port: int                        # TIB_PORT (or START_PORT)
    queue_max: int                   # GATEWAY_QUEUE_MAX: waiting requests; more are a 429 at once
    health_interval_s: float         # GATEWAY_HEALTH_INTERVAL_MS: every upstream's GET /v1/models
    health_timeout_s: float          # GATEWAY_HEALTH_TIMEOUT_MS: one such check's limit
    connect_timeout_s: float         # GATEWAY_CONNECT_TIMEOUT_MS: opening a connection to an upstream
    breaker_failures: int            # GATEWAY_BREAKER_FAILURES: consecutive 5xx/connection errors that open it
    breaker_open_s: float            # GATEWAY_BREAKER_OPEN_MS: how long an open breaker keeps traffic away
    routing: str                     # GATEWAY_ROUTING: prefix | least_connection
    prefix_block_bytes: int          # GATEWAY_PREFIX_BLOCK_BYTES: granularity of the prefix tree
    prefix_max_bytes: int            # GATEWAY_PREFIX_MAX_BYTES: how much of a request's text is indexed
    prefix_cache_blocks: int         # GATEWAY_PREFIX_CACHE_BLOCKS: blocks remembered per upstream (LRU)
    max_body_bytes: int              # MAX_BODY_BYTES: larger request bodies are a 413
    cors_allow_origins: tuple[str, ...]  # CORS_ALLOW_ORIGINS: web origins that may call it ("*": any), as the frontend
    policy: PolicyConfig             # the master's routing knobs (imbalance guard, ties)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GatewayConfig:
        upstreams = tuple(_upstream(u) for u in env.get("UPSTREAMS", "").split(",") if u.strip())
        if not upstreams:
            raise ValueError("the gateway needs UPSTREAMS: comma-separated base URLs of OpenAI-compatible "
                             "servers, e.g. http://llama-2:8000,http://falcon:8000")
        if len(set(upstreams)) != len(upstreams):
            raise ValueError(f"UPSTREAMS names the same server twice: {','.join(upstreams)}")
        port = env_int(env, "TIB_PORT", 0, minimum=1) or env_int(env, "START_PORT", DEFAULT_PORT, minimum=1)
        if port > 65535:
            raise ValueError(f"TIB_PORT must be a port number, got {port}")
        return cls(
            upstreams=upstreams,
            max_connect_per_upstream=env_int(env, "MAX_CONNECT_PER_UPSTREAM", 1, minimum=1),
            wait_for_s=env_int(env, "WAIT_FOR", 5000, minimum=0) / 1000,
            timeout_s=env_int(env, "TIMEOUT", 600_000, minimum=1) / 1000,
            debug=_flag(env, "DEBUG"),
            host=env_str(env, "HOST", "0.0.0.0"),
            port=port,
            queue_max=env_int(env, "GATEWAY_QUEUE_MAX", 1024, minimum=0),
            health_interval_s=env_int(env, "GATEWAY_HEALTH_INTERVAL_MS", 10_000, minimum=50) / 1000,
            health_timeout_s=env_int(env, "GATEWAY_HEALTH_TIMEOUT_MS", 3000, minimum=10) / 1000,
            connect_timeout_s=env_int(env, "GATEWAY_CONNECT_TIMEOUT_MS", 3000, minimum=10) / 1000,
            breaker_failures=env_int(env, "GATEWAY_BREAKER_FAILURES", 5, minimum=1),
            breaker_open_s=env_int(env, "GATEWAY_BREAKER_OPEN_MS", 30_000, minimum=0) / 1000,
            routing=env_choice(env, "GATEWAY_ROUTING", ROUTING_PREFIX, (ROUTING_PREFIX, ROUTING_LEAST_CONNECTION)),
            prefix_block_bytes=env_int(env, "GATEWAY_PREFIX_BLOCK_BYTES", 64, minimum=1),
            prefix_max_bytes=env_int(env, "GATEWAY_PREFIX_MAX_BYTES", 65_536, minimum=0),
            prefix_cache_blocks=env_int(env, "GATEWAY_PREFIX_CACHE_BLOCKS", 200_000, minimum=1),
            max_body_bytes=env_int(env, "MAX_BODY_BYTES", 8 << 20, minimum=1024),
            cors_allow_origins=tuple(o.strip() for o in env.get("CORS_ALLOW_ORIGINS", "").split(",") if o.strip()),
            policy=PolicyConfig(
                imbalance_abs=env_int(env, "GATEWAY_IMBALANCE_ABS", 8, minimum=0),
                imbalance_ratio=env_int(env, "GATEWAY_IMBALANCE_PCT", 150, minimum=100) / 100,
            ),
        )


def _upstream(raw: str) -> str:
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"UPSTREAMS entries are http(s)://host:port URLs, got {raw.strip()!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"UPSTREAMS entry {raw.strip()!r} has a bad port") from None
    # The seed's upstreams are base URLs; one given as ".../v1" means the same server.
    return url.removesuffix("/v1")


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be true or false, got {env[name]!r}")
