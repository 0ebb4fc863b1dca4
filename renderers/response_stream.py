"""The renderer's output post-processing (RTP-LLM's `render_response_stream`): one choice's generated text,
after detokenize and stop strings, → its message parts as OpenAI's shapes, piece by piece as they are
decided. A delta is `{"content": text}` or `{"tool_calls": [...]}`; a tool call's deltas carry `index`,
`id`, `type` and `function.name` first, then `function.arguments` in fragments as the model writes them
(the parser's `pending` call), as the official client assembles them. A whole answer is the same stream
fed at once (whole_message), so streamed and whole answers cannot differ.

ChatRenderer.render_response_stream picks the stream for a request: ToolCallStream over the renderer's
tool parser when the request offers tools, else PlainText; a renderer may return its own."""
from __future__ import annotations

import uuid
from typing import Any

from renderers.tool_parsers import ToolEvent, ToolParser

Delta = dict[str, Any]

# Arguments stream as generated; text that arrives at once (held back by stop-string matching, a whole
# call in one backend message) still goes out in fragments of at most this many characters.
ARGUMENT_FRAGMENT_CHARS = 24


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ResponseStream:
    """One choice's text → deltas. The base class passes the text through unchanged."""

    def __init__(self) -> None:
        self.calls = 0   # tool calls announced so far (the next one's index)

    def feed(self, text: str) -> list[Delta]:
        """More generated text; returns what is decided (a renderer may hold text back)."""
        return [{"content": text}] if text else []

    def finish(self) -> list[Delta]:
        """The choice ended: whatever is held back."""
        return []


PlainText = ResponseStream


def whole_message(stream: ResponseStream, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole answer through `stream`. With calls, content is the text around
    them (stripped), or None."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in stream.feed(text) + stream.finish():
        content.append(delta.get("content") or "")
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            fn = piece.get("function", {})
            call["function"]["name"] += fn.get("name", "")
            call["function"]["arguments"] += fn.get("arguments", "")
    if calls:
        return "".join(content).strip() or None, [calls[i] for i in sorted(calls)]
    return "".join(content), []


class ToolCallStream(ResponseStream):
    """Text and tool calls, as a tool parser (renderers/tool_parsers.py) reads them."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self.parser = parser
        self._sent: str | None = None  # the call being written: arguments sent so far (None: no call open)

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self.parser.feed(text)) + self._pending() if text else []

    def finish(self) -> list[Delta]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events: list[ToolEvent]) -> list[Delta]:
        out: list[Delta] = []
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

    def _pending(self) -> list[Delta]:
        call = self.parser.pending()
        if call is None:
            return []
        out = [self._announce(call.name)] if self._sent is None else []
        sent = self._sent or ""
        self._sent = call.arguments
        return out + self._arguments(call.arguments[len(sent):])

    def _announce(self, name: str) -> Delta:
        self.calls += 1
        self._sent = ""
        return {"tool_calls": [{"index": self.calls - 1, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str) -> list[Delta]:
        index = self.calls - 1
        return [{"tool_calls": [{"index": index, "function": {"arguments": text[start:start + ARGUMENT_FRAGMENT_CHARS]}}]}
                for start in range(0, len(text), ARGUMENT_FRAGMENT_CHARS)]
