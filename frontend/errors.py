"""The frontend's error tail: what a stream sends once its 200 and headers are gone."""
from __future__ import annotations

import logging
from typing import Any

from kvyard.errors import ErrorCode, RequestError
from kvyard.http_errors import request_error_body

log = logging.getLogger("kvyard.frontend")


def stream_error_body(exc: Exception) -> dict[str, Any]:
    """The error object a stream sends once its 200 and headers are gone: a RequestError's own; anything
    else (a bug, a backend answering nonsense) is logged here and sent as INTERNAL, so the client still
    gets an error chunk and the stream's end marker instead of a dropped connection."""
    if not isinstance(exc, RequestError):
        log.error("a stream failed after its headers were sent", exc_info=exc)
        exc = RequestError(ErrorCode.INTERNAL, "internal error; see the frontend log")
    return request_error_body(exc)[1]
