"""The frontend's OpenAPI document says what the server does: a bad request is a 400 with the OpenAI error
object (never FastAPI's 422 validation shape), every refusal in the error table is listed, and the
generation routes that stream answer `text/event-stream` when asked to (SSE_RESPONSE: frontend/dialect.py
adds it to every dialect's route)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvyard.http_errors import ERROR_TABLE


# A generation route's 200 is an SSE stream when the request asks for one ("stream": true, or an Accept
# header for /generate); the route's openapi_extra, merged into its operation.
SSE_RESPONSE = {"responses": {"200": {"content": {"text/event-stream": {
    "schema": {"type": "string", "description": "Server-sent events, ending with `data: [DONE]` (chat and "
               "completions)"}}}}}}

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _error_responses() -> dict[str, Any]:
    by_status: dict[int, list[str]] = {}
    for code, (status, _) in ERROR_TABLE.items():
        by_status.setdefault(status, []).append(code.value)
    return {str(status): {"description": "OpenAI error object; code: " + ", ".join(sorted(codes)),
                          "content": {"application/json": {"schema": _ERROR_REF}}}
            for status, codes in sorted(by_status.items())}


def install_openapi(app: FastAPI) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas["ErrorResponse"] = ERROR_SCHEMA
            errors = _error_responses()
            for methods in doc.get("paths", {}).values():
                for method, op in methods.items():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    if method in ("post", "put", "patch"):
                        responses.update({k: v for k, v in errors.items() if k not in responses})
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
