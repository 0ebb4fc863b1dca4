"""The one OpenAI error shape every kvyard HTTP role answers with, checked the same way by every test."""
from __future__ import annotations

from typing import Any

import httpx

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """`resp` is `status` with body {"error": {message, type, param, code}} (message and type non-empty
    strings, code as given); returns the error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert isinstance(body["error"]["type"], str) and body["error"]["type"], body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]
