"""RTP-LLM's per-request bookkeeping fields, shared by chat, completions and `POST /`: private_request (the
prompt stays out of the logs), trace_id (heads the backend request id), chat_id (the response's id),
extend_fields (passed back) and master_info (refused)."""
from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from pydantic import BaseModel, field_validator

log = logging.getLogger("kvyard.frontend")

_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # ids that go into log lines and response ids as they are


class RtpRequestFields(BaseModel):
    private_request: bool = False  # its prompt never goes to the logs (not even at LOG_LEVEL=DEBUG)
    trace_id: str | None = None    # the caller's trace: heads the backend request id, so its log lines carry it
    chat_id: str | None = None     # the response's `id` (the backend request id stays unique)
    extend_fields: dict[str, Any] | None = None  # passed back as they came, in the response
    master_info: dict[str, Any] | None = None    # RTP-LLM's pre-made routing: refused (the frontend asks the master)

    @field_validator("trace_id", "chat_id")
    @classmethod
    def _plain_id(cls, v: str | None) -> str | None:
        if v is not None and not _PLAIN_ID.fullmatch(v):
            raise ValueError("must be 1-128 characters of letters, digits and . _ : -")
        return v

    @field_validator("master_info")
    @classmethod
    def _no_master_info(cls, v: dict[str, Any] | None) -> None:
        if v is not None:
            raise ValueError("is not supported: kvyard's frontend asks its master (MASTER_ADDRESS) for every "
                             "request and takes no routing from the client")
        return None

    def backend_request_id(self, dialect_prefix: str) -> str:
        """The backend's request id: unique per call (a chat_id may repeat), headed by the caller's trace_id."""
        return f"{self.trace_id or dialect_prefix}-{uuid.uuid4().hex}"

    def echoed(self) -> dict[str, Any]:
        """extend_fields come back as they were sent (streaming: on the first event)."""
        return {"extend_fields": self.extend_fields} if self.extend_fields is not None else {}

    def log_prompt(self, request_id: str, prompt: str, n_tokens: int) -> None:
        """LOG_LEVEL=DEBUG (or /set_log_level): the prompt as the backend receives it, unless private."""
        if not self.private_request:
            log.debug("%s rendered prompt (%d tokens): %r", request_id, n_tokens, prompt)
