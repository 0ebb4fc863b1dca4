"""The cluster credential: one shared token that every internal call carries (registration, schedule, status
polls, frontend → backend and prefill → decode gRPC, backend HTTP) and every internal port checks.

Read once per role from CLUSTER_TOKEN or CLUSTER_TOKEN_FILE (by the role's config). Without one, a role's
internal ports are open, so they must stay on loopback (a non-loopback HOST is refused) and the master
refuses registrations; the launcher generates a token for the processes it starts itself.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import request_error_body

MIN_TOKEN_CHARS = 16
HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"  # load balancers and probes check it with no token


def read_cluster_token(env: Mapping[str, str]) -> str:
    """CLUSTER_TOKEN, or the first line of the file CLUSTER_TOKEN_FILE names (a mounted k8s Secret);
    "" when neither is set."""
    token, path = env.get("CLUSTER_TOKEN", ""), env.get("CLUSTER_TOKEN_FILE", "")
    if token and path:
        raise ValueError("set CLUSTER_TOKEN or CLUSTER_TOKEN_FILE, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"CLUSTER_TOKEN_FILE {path!r} cannot be read: {exc}") from None
        if not token:
            raise ValueError(f"CLUSTER_TOKEN_FILE {path!r} is empty")
    what = "CLUSTER_TOKEN_FILE's token" if path else "CLUSTER_TOKEN"
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what} must be at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    if token and not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{what} must be printable ASCII with no spaces (it travels in an HTTP header)")
    return token


def internal_token(env: Mapping[str, str], host: str) -> str:
    """The token of a role with internal ports bound to `host`: without one they only open on loopback."""
    token = read_cluster_token(env)
    if not token and not is_loopback(host):
        raise ValueError(f"HOST={host} opens the internal ports to the network: set CLUSTER_TOKEN (or "
                         "CLUSTER_TOKEN_FILE), shared by every role of the cluster, so they refuse strangers")
    return token


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_matches(expected: str, presented: str) -> bool:
    """Constant time, so the answer's timing does not reveal how much of a guess was right."""
    return hmac.compare_digest(expected.encode(), presented.encode())


def bearer(header_value: str) -> str:
    scheme, _, value = header_value.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def auth_headers(token: str) -> dict[str, str]:
    """For an httpx client to the master or a backend's HTTP port; {} when no token is configured."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def grpc_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# ---- HTTP: internal ports ---------------------------------------------------------------------

class ClusterAuthMiddleware:
    """Every path but `open_paths` needs `Authorization: Bearer <cluster token>`, else a 401 with the
    OpenAI error object. Deny by default: a route added later is protected without a second thought."""

    def __init__(self, app: Any, token: str, open_paths: Iterable[str]) -> None:
        self.app = app
        self.token = token
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.open_paths:
            given = bearer(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
            if not token_matches(self.token, given):
                await _refuse(scope, send, "missing cluster token" if not given else "wrong cluster token")
                return
        await self.app(scope, receive, send)


async def _refuse(scope: dict[str, Any], send: Any, why: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    status, body = request_error_body(RequestError(
        ErrorCode.UNAUTHENTICATED, f"{why}: internal endpoints need 'Authorization: Bearer <CLUSTER_TOKEN>'"))
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": raw})


def install_cluster_auth(app: Any, token: str, open_paths: Iterable[str]) -> None:
    """Adds the check to a FastAPI app when a token is configured (add it before the outer middleware)."""
    if token:
        app.add_middleware(ClusterAuthMiddleware, token=token, open_paths=tuple(open_paths))


# ---- gRPC -----------------------------------------------------------------------------------

class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but the health service needs the `authorization: Bearer <token>` metadata, else
    UNAUTHENTICATED before the servicer runs."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(self, continuation: Callable[..., Any],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_SERVICE_PREFIX):
            return handler
        given = next((bearer(v) for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if token_matches(self.token, given):
            return handler
        return _denying(handler, "missing cluster token" if not given else "wrong cluster token")


def _denying(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{why}: this backend needs 'authorization: Bearer <CLUSTER_TOKEN>' metadata")

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                   handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    return [TokenServerInterceptor(token)] if token else []


class _AddToken:
    """Adds the token to every call of a channel whose call sites we do not want to touch. grpc.aio files
    an interceptor under its first matching kind only, hence one subclass per kind."""

    def __init__(self, token: str) -> None:
        self.metadata = grpc_metadata(token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self.metadata))


class _UnaryUnaryToken(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _UnaryStreamToken(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _StreamUnaryToken(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


class _StreamStreamToken(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request_iterator)


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [kind(token) for kind in kinds] if token else []
