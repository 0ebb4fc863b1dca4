"""Per-request error kinds shared by every role; kvyard/http_errors.py maps them to HTTP statuses."""
from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import Enum
from typing import Any


class ErrorCode(Enum):
    INVALID_ARGUMENT = "invalid_argument"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    OUT_OF_KV_CACHE = "out_of_kv_cache"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    MODEL_NOT_FOUND = "model_not_found"
    UNAVAILABLE = "unavailable"  # no backend can be reached, or this server is draining
    UNAUTHENTICATED = "invalid_api_key"  # an API key is configured and the request lacks it
    PAYLOAD_TOO_LARGE = "payload_too_large"  # the request body is over the configured limit
    BODY_TIMEOUT = "request_timeout"  # the client did not send its whole body in time
    INTERNAL = "internal"


class RequestError(Exception):
    """A request failed for a reason the caller should see; other requests are unaffected."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param  # the request field at fault, when there is one

    def __repr__(self) -> str:
        return f"RequestError({self.code.name}, {self.message!r})"


def refuse_unknown_fields(body: Mapping[str, Any], known: Collection[str], note: str = "") -> None:
    """A request key the route does not take is a 400 naming it (OpenAI's wording, + note), never ignored."""
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"Unrecognized request argument supplied: {unknown[0]}{note}",
                           unknown[0])
