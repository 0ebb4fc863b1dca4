"""Parsed tool calls → OpenAI's shapes (after detokenize and stop strings, before the response is built):
`message.tool_calls` for a whole answer; for a stream, deltas that carry `index`, `id`, `type` and
`function.name` first, then `function.arguments` in fragments, as the official client assembles them."""
from __future__ import annotations

import uuid
from typing import Any

from renderers import ToolEvent, ToolParser

ARGUMENT_FRAGMENT_CHARS = 24   # a call is decided whole (see renderers/tool_parsers.py); sent in pieces


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_parts(events: list[ToolEvent]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole answer. With calls, content is the text around them, or None."""
    text = "".join(ev.text for ev in events if ev.call is None)
    calls = [{"id": new_call_id(), "type": "function",
              "function": {"name": ev.call.name, "arguments": ev.call.arguments}}
             for ev in events if ev.call is not None]
    if calls:
        return text.strip() or None, calls
    return text, []


class ToolCallStream:
    """One choice's streamed text → delta bodies: {"content": ...} or {"tool_calls": [...]}."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.calls = 0   # calls sent so far: the next one's index

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events: list[ToolEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if ev.call is None:
                if ev.text:
                    out.append({"content": ev.text})
                continue
            index, self.calls = self.calls, self.calls + 1
            out.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                        "function": {"name": ev.call.name, "arguments": ""}}]})
            args = ev.call.arguments
            for start in range(0, len(args), ARGUMENT_FRAGMENT_CHARS):
                out.append({"tool_calls": [{"index": index, "function": {
                    "arguments": args[start:start + ARGUMENT_FRAGMENT_CHARS]}}]})
        return out
