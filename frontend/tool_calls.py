"""Parsed tool calls → OpenAI's shapes (after detokenize and stop strings, before the response is built):
`message.tool_calls` for a whole answer; for a stream, deltas that carry `index`, `id`, `type` and
`function.name` first, then `function.arguments` in fragments as the model writes them (the parser's
`pending` call), as the official client assembles them."""
from __future__ import annotations

import uuid
from typing import Any

from renderers import ToolEvent, ToolParser

# Arguments stream as generated; text that arrives at once (held back by stop-string matching, a whole
# call in one backend message) still goes out in fragments of at most this many characters.
ARGUMENT_FRAGMENT_CHARS = 24


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
        self.calls = 0   # calls announced so far: the next one's index
        self._sent: str | None = None  # the call being written: arguments sent so far (None: no call open)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(text)) + self._pending() if text else []

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events: list[ToolEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if ev.call is None:
                if ev.text:
                    out.append({"content": ev.text})
                continue
            if self._sent is None:  # decided and finished at once: announce it now
                out.append(self._announce(ev.call.name))
            sent, self._sent = self._sent or "", None
            # The parser's pending arguments are a prefix of the finished call's (renderers/tool_parsers.py).
            out += self._arguments(ev.call.arguments[len(sent):] if ev.call.arguments.startswith(sent) else "")
        return out

    def _pending(self) -> list[dict[str, Any]]:
        call = self.parser.pending()
        if call is None:
            return []
        out = [self._announce(call.name)] if self._sent is None else []
        sent = self._sent or ""
        self._sent = call.arguments
        return out + self._arguments(call.arguments[len(sent):])

    def _announce(self, name: str) -> dict[str, Any]:
        self.calls += 1
        self._sent = ""
        return {"tool_calls": [{"index": self.calls - 1, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        index = self.calls - 1
        return [{"tool_calls": [{"index": index, "function": {"arguments": text[start:start + ARGUMENT_FRAGMENT_CHARS]}}]}
                for start in range(0, len(text), ARGUMENT_FRAGMENT_CHARS)]
