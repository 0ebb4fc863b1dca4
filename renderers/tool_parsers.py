"""Tool-call formats by name: how a model is told about tools when its template cannot (the system-prompt
text), how its earlier calls are written back into the conversation, and how its output is parsed back
into calls, streaming or not. Output that does not parse as a call is returned as plain text, never raised.

A parser is stateful and belongs to one choice of one request: `feed` text as it is generated, `finish`
at the end; both return events (plain text, or one complete call). `parse` does both for a whole text.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
        return _coalesce([*self.feed(text), *self.finish()])

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


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def wrap(cls: type[ToolParser]) -> type[ToolParser]:
        for name in names:
            if name in _PARSERS:
                raise ValueError(f"a tool parser is already registered as {name!r}")
            _PARSERS[name] = cls
        return cls
    return wrap


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in _PARSERS:
        raise ValueError(f"no tool parser {name!r}; known: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]


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


def _choice_line(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "\n\nYou must call at least one function."
    if isinstance(tool_choice, dict) and tool_choice.get("function", {}).get("name"):
        return f"\n\nYou must call the function {tool_choice['function']['name']!r}."
    return ""


def _coalesce(events: list[ToolEvent]) -> list[ToolEvent]:
    out: list[ToolEvent] = []
    for ev in events:
        if ev.call is None and not ev.text:
            continue
        if ev.call is None and out and out[-1].call is None:
            out[-1] = ToolEvent(text=out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


@register_tool_parser("hermes", "qwen")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them (Hermes,
    Qwen 2/2.5/3). A call is decided when its closing tag arrives; one whose JSON is malformed is text."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""          # held text (outside) or the call's body so far (inside)
        self._inside = False
        self._after_call = False  # drop the whitespace models put between and after calls

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    return _coalesce(events)
                body, self._buf = self._buf[:end], self._buf[end + len(self.CLOSE):]
                self._inside = False
                events.append(self._call_or_text(body, closed=True))
                continue
            start = self._buf.find(self.OPEN)
            if start >= 0:
                events.append(self._text(self._buf[:start]))
                self._buf = self._buf[start + len(self.OPEN):]
                self._inside = True
                continue
            keep = _partial_suffix(self._buf, self.OPEN)
            events.append(self._text(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            return _coalesce(events)

    def finish(self) -> list[ToolEvent]:
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            return _coalesce([self._call_or_text(buf, closed=False)])  # eos before the closing tag
        return _coalesce([self._text(buf)])

    def _text(self, text: str) -> ToolEvent:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return ToolEvent(text=text)

    def _call_or_text(self, body: str, closed: bool) -> ToolEvent:
        try:
            call = call_from_json(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            self._after_call = False
            return ToolEvent(text=self.OPEN + body + (self.CLOSE if closed else ""))
        self._after_call = True
        return ToolEvent(call=call)

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]], tool_choice: Any) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to help with the user's request. "
                f"The functions are described inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
                "To call a function, write a JSON object with its name and arguments inside "
                "<tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
                + _choice_line(tool_choice))

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{cls.OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{cls.CLOSE}" for c in calls)


@register_tool_parser("json", "llama3_json", "mistral")
class JsonToolParser(ToolParser):
    """The whole output is JSON: one call object, a list of them, or several separated by `;` or
    newlines, optionally after `[TOOL_CALLS]` (Mistral) or `<|python_tag|>` (Llama 3.1). Output that
    starts like that is held until the end, then parsed; anything else streams through as text."""
    name = "json"
    PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "undecided"   # → "text" (stream through) or "json" (hold to the end)

    def feed(self, text: str) -> list[ToolEvent]:
        if self._mode == "text":
            return _coalesce([ToolEvent(text=text)])
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if not head or any(p.startswith(head) for p in self.PREFIXES):
                return []   # nothing decisive yet
            if head[0] in "{[" or head.startswith(self.PREFIXES):
                self._mode = "json"
                return []
            self._mode = "text"
            buf, self._buf = self._buf, ""
            return _coalesce([ToolEvent(text=buf)])
        return []

    def finish(self) -> list[ToolEvent]:
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return _coalesce([ToolEvent(text=buf)])
        calls = self._calls(buf)
        return [ToolEvent(call=c) for c in calls] if calls else _coalesce([ToolEvent(text=buf)])

    def _calls(self, text: str) -> list[ParsedToolCall]:
        body = text.strip()
        for p in self.PREFIXES:
            if body.startswith(p):
                body = body[len(p):].lstrip()
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while pos < len(body):
            try:
                value, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return []
            items = value if isinstance(value, list) else [value]
            parsed = [call_from_json(item) for item in items]
            if not parsed or any(c is None for c in parsed):
                return []
            calls.extend(c for c in parsed if c is not None)
            while pos < len(body) and body[pos] in " \t\r\n;,":
                pos += 1
        return calls

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]], tool_choice: Any) -> str:
        listed = json.dumps(tools, ensure_ascii=False, indent=1)
        return ("You have access to the following functions:\n" + listed + "\n\nTo call functions, answer "
                'with only a JSON list and nothing else: [{"name": <function-name>, "arguments": '
                "<arguments-json-object>}, ...]. Otherwise answer normally." + _choice_line(tool_choice))

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        return json.dumps(calls, ensure_ascii=False)
