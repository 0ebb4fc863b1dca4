"""The one table from error kind to HTTP status, and the OpenAI error object every HTTP role (frontend, master,
gateway, mock master) answers a failure with."""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvyard.errors import ErrorCode, RequestError

log = logging.getLogger("kvyard.http")

# kind → (HTTP status, OpenAI error type)
ERROR_TABLE: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    ErrorCode.OUT_OF_KV_CACHE: (400, "invalid_request_error"),
    ErrorCode.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.BODY_TIMEOUT: (408, "invalid_request_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.CANCELLED: (499, "cancelled"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    ErrorCode.INTERNAL: (500, "internal_error"),
}


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def request_error_body(exc: RequestError) -> tuple[int, dict[str, Any]]:
    status, err_type = ERROR_TABLE[exc.code]
    return status, error_body(exc.message, err_type, exc.param, exc.code.value)


def request_error_response(exc: RequestError) -> JSONResponse:
    status, body = request_error_body(exc)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "dict", "list"})


def _union_tag(part: Any) -> bool:
    """Pydantic names the member of a union it tried (`input.str`, `prompt.list[int].0`): not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part
                                      or part.startswith(("function-", "constrained-")))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return request_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI clients expect 400 with one readable message.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_tag(p)]
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', 'parse error')}", None
        elif first.get("type") == "extra_forbidden":  # a field no request model names: OpenAI's wording
            param = ".".join(loc) or None
            message = f"Unrecognized request argument supplied: {param}"
        else:
            param = ".".join(loc) or None
            message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), 400)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse(error_body(f"malformed JSON body: {exc}", "invalid_request_error"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), err_type), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal error; see the frontend log", "internal_error"), 500)
