"""Tool-call formats by name: how a model is told about tools when its template cannot (the system-prompt
text), how its earlier calls are written back into the conversation, how its output is parsed back into
calls, streaming or not, and the grammar that forces a call (tool_choice "required" or a named function).
Output that does not parse as a call is returned as plain text, never raised.

The formats themselves: renderers/hermes_tools.py and renderers/json_tools.py (registered by
renderers/__init__.py). A parser is stateful and belongs to one choice of one request: `feed` text as it is generated, `finish`
at the end; both return events (plain text, or one complete call). `parse` does both for a whole text.
While a call is being written, `pending` shows it as far as it is decided, so its arguments can stream.
A call is decided once its name is complete and its arguments have begun with valid JSON (the opening and
one more character); before that a malformed call is still plain text, after it the call stands, with its
arguments as the model wrote them.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kvyard.constraint import JSON_STYLE
from renderers.named import Named
from renderers.partial_json import JsonReader


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI's function.arguments


@dataclass(frozen=True)
class ToolEvent:
    """Either plain text for the message content, or one complete tool call."""
    text: str = ""
    call: ParsedToolCall | None = None


class ToolParser(ABC):
    name = "abstract"

    @abstractmethod
    def feed(self, text: str) -> list[ToolEvent]:
        """More generated text; returns what is decided (text that might start a call is held back)."""

    @abstractmethod
    def finish(self) -> list[ToolEvent]:
        """The output ended: whatever is held back, as calls if they are complete, else as text."""

    def parse(self, text: str) -> list[ToolEvent]:
        return coalesce([*self.feed(text), *self.finish()])

    @classmethod
    @abstractmethod
    def tools_prompt(cls, tools: list[dict[str, Any]], tool_choice: Any) -> str:
        """System-prompt text describing the tools and the output format, for templates without tools."""

    @classmethod
    @abstractmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's earlier calls ({"name", "arguments": dict}) as the model writes them."""

    @classmethod
    def format_result(cls, content: str) -> str:
        """A tool result, as the text of a user turn."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def pending(self) -> ParsedToolCall | None:
        """The call being written now, once decided: its name and its arguments' text so far (a prefix of
        the arguments the finished call will have). None between calls or while undecided."""
        return None

    @classmethod
    @abstractmethod
    def calls_grammar(cls, calls: list[dict[str, Any]], parallel: bool, answer: dict[str, Any] | None = None) -> str:
        """A Lark grammar (llguidance's dialect) for this format's tool calls: one or more (`parallel`) calls,
        each a JSON object matching one of `calls` (JSON schemas of {"name", "arguments"}); or, with
        `answer` (a JSON schema), either that JSON answer or the calls."""


_PARSERS: Named[type[ToolParser]] = Named("tool parser")
register_tool_parser = _PARSERS.register
get_tool_parser = _PARSERS.get


def call_from_json(obj: Any) -> ParsedToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} → a call; anything else → None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_rule(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark rule's body, written in kvyard's JSON style unless it says otherwise."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


def _is_json(text: str | None) -> bool:
    try:
        return text is not None and (json.loads(text), True)[1]
    except json.JSONDecodeError:
        return False


def one_of(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


@dataclass
class CallReader:
    """One call object being written: a JsonReader over its text, and what it has decided."""
    reader: JsonReader
    prefix: tuple[str | int, ...] = ()   # where the object sits in the reader's value ((): it is the value)

    @property
    def name(self) -> str | None:
        return self.reader.string(self.reader.span(*self.prefix, "name")) or None

    def _arguments(self):  # noqa: ANN202 - a partial_json.Span or None
        return self.reader.span(*self.prefix, "arguments") or self.reader.span(*self.prefix, "parameters")

    @property
    def committed(self) -> bool:
        """Name complete and arguments begun with valid JSON (a string value counts only once complete)."""
        args = self._arguments()
        if self.name is None or args is None:
            return False
        if args.kind == "string":  # JSON text in a string: decided once complete, if it is JSON
            return _is_json(self.reader.string(args))
        return args.progressed or args.end is not None

    def arguments_so_far(self) -> str:
        args = self._arguments()
        if args is None or args.kind == "string":
            return ""
        end = args.end if args.end is not None else len(self.reader.text) - (0 if self.reader.valid else 1)
        return self.reader.text[args.start:end]

    def call(self, text: str) -> ParsedToolCall | None:
        """The finished call, `text` being everything the model wrote from where the reader started: a
        committed call stands even if its JSON broke later (its arguments then run to the end of `text`);
        an undecided one only if its object parses as a call."""
        args = self._arguments()
        if self.committed and args is not None and self.name is not None:
            if args.kind == "string":
                return ParsedToolCall(self.name, self.reader.string(args) or "")
            return ParsedToolCall(self.name, text[args.start:args.end] if args.end is not None
                                  else text[args.start:].rstrip())
        obj = self.reader.span(*self.prefix)
        own = text if obj is None else text[obj.start:obj.end if obj.end is not None else len(text)]
        try:
            call = call_from_json(json.loads(own))
        except json.JSONDecodeError:
            return None
        if call is not None and args is not None and args.end is not None and args.kind in ("object", "array"):
            return ParsedToolCall(call.name, text[args.start:args.end])  # as written, like a streamed call
        return call


def choice_line(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "\n\nYou must call at least one function."
    if isinstance(tool_choice, dict) and tool_choice.get("function", {}).get("name"):
        return f"\n\nYou must call the function {tool_choice['function']['name']!r}."
    return ""


def coalesce(events: list[ToolEvent]) -> list[ToolEvent]:
    out: list[ToolEvent] = []
    for ev in events:
        if ev.call is None and not ev.text:
            continue
        if ev.call is None and out and out[-1].call is None:
            out[-1] = ToolEvent(text=out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0
