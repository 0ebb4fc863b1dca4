"""Tool-call formats by name: how a model is told about tools when its template cannot (the system-prompt
text), how its earlier calls are written back into the conversation, how its output is parsed back into
calls, streaming or not, and the grammar that forces a call (tool_choice "required" or a named function).
Output that does not parse as a call is returned as plain text, never raised.

A parser is stateful and belongs to one choice of one request: `feed` text as it is generated, `finish`
at the end; both return events (plain text, or one complete call). `parse` does both for a whole text.
While a call is being written, `pending` shows it as far as it is decided, so its arguments can stream.
A call is decided once its name is complete and its arguments have begun with valid JSON (the opening and
one more character); before that a malformed call is still plain text, after it the call stands, with its
arguments as the model wrote them.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvyard.constraint import JSON_STYLE
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
class _CallReader:
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
    Qwen 2/2.5/3). A call ends at its closing tag (or the end of the output)."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""          # held text (outside) or the call's body so far (inside)
        self._inside = False
        self._after_call = False  # drop the whitespace models put between and after calls
        self._call: _CallReader | None = None  # inside: the body read as JSON (what is surely body)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    self._read_body(len(self._buf) - _partial_suffix(self._buf, self.CLOSE))
                    return _coalesce(events)
                self._read_body(end)
                body, self._buf = self._buf[:end], self._buf[end + len(self.CLOSE):]
                self._inside = False
                events.append(self._call_or_text(body, closed=True))
                continue
            start = self._buf.find(self.OPEN)
            if start >= 0:
                events.append(self._text(self._buf[:start]))
                self._buf = self._buf[start + len(self.OPEN):]
                self._inside = True
                self._call = _CallReader(JsonReader(max_depth=1))
                continue
            keep = _partial_suffix(self._buf, self.OPEN)
            events.append(self._text(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            return _coalesce(events)

    def finish(self) -> list[ToolEvent]:
        if self._inside:
            self._read_body(len(self._buf))
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            return _coalesce([self._call_or_text(buf, closed=False)])  # eos before the closing tag
        return _coalesce([self._text(buf)])

    def pending(self) -> ParsedToolCall | None:
        if not self._inside or self._call is None or not self._call.committed:
            return None
        assert self._call.name is not None
        return ParsedToolCall(self._call.name, self._call.arguments_so_far())

    def _read_body(self, upto: int) -> None:
        """The body's first `upto` characters are surely body (not the start of the closing tag)."""
        assert self._call is not None
        seen = len(self._call.reader.text)
        if upto > seen and self._call.reader.valid:
            self._call.reader.feed(self._buf[seen:upto])

    def _text(self, text: str) -> ToolEvent:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return ToolEvent(text=text)

    def _call_or_text(self, body: str, closed: bool) -> ToolEvent:
        assert self._call is not None
        call, self._call = self._call.call(body), None
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

    @classmethod
    def calls_grammar(cls, calls: list[dict[str, Any]], parallel: bool, answer: dict[str, Any] | None = None) -> str:
        # Written the way format_calls writes earlier calls into the prompt, so the model sees its own style.
        rules = [f"call: {json.dumps(cls.OPEN + chr(10))} {json_rule(one_of(calls))} {json.dumps(chr(10) + cls.CLOSE)}",
                 'calls: call ("\\n" call)*' if parallel else "calls: call"]
        if answer is None:
            return "\n".join(["start: calls", *rules])
        return "\n".join(["start: answer | calls", f"answer: {json_rule(answer)}", *rules])


@register_tool_parser("json", "llama3_json", "mistral")
class JsonToolParser(ToolParser):
    """The whole output is JSON: one call object, a list of them, or several separated by `;` or
    newlines, optionally after `[TOOL_CALLS]` (Mistral) or `<|python_tag|>` (Llama 3.1). Output that
    starts like that is held until a call is decided (then the calls stream) or the end (then it is
    calls only if every item is one, else text); anything else streams through as text."""
    name = "json"
    PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")
    SEPARATORS = " \t\r\n;,"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "undecided"   # → "text" (stream through) or "json" (calls, decided item by item)
        self._body_at = 0          # json: where the JSON begins in _buf (after a prefix)
        self._values: list[tuple[int, JsonReader]] = []  # json: each top-level value, by its offset in the body
        self._fed = 0              # json: body characters read so far
        self._committed = False    # json: a call was decided, so the output is calls
        self._sent = 0             # json, committed: items returned as events so far

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
                self._body_at = len(self._buf) - len(head)
                prefix = next((p for p in self.PREFIXES if head.startswith(p)), "")
                self._body_at += len(prefix)
            else:
                self._mode = "text"
                buf, self._buf = self._buf, ""
                return _coalesce([ToolEvent(text=buf)])
        self._read()
        return self._ready(final=False)

    def finish(self) -> list[ToolEvent]:
        if self._mode == "json":
            self._read()
            if self._committed:
                return self._ready(final=True)
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return _coalesce([ToolEvent(text=buf)])
        calls = self._calls(buf)
        return [ToolEvent(call=c) for c in calls] if calls else _coalesce([ToolEvent(text=buf)])

    def pending(self) -> ParsedToolCall | None:
        if not self._committed:
            return None
        items = self._items()
        if self._sent >= len(items):
            return None
        call = items[self._sent][1]
        if not call.committed:
            return None
        assert call.name is not None
        return ParsedToolCall(call.name, call.arguments_so_far())

    def _read(self) -> None:
        body = self._buf[self._body_at:]
        while self._fed < len(body):
            if not self._values or self._values[-1][1].done:
                if body[self._fed] in self.SEPARATORS:
                    self._fed += 1
                    continue
                self._values.append((self._fed, JsonReader(max_depth=2)))
            reader = self._values[-1][1]
            if not reader.valid:
                return
            self._fed += reader.feed(body[self._fed:])
            if not reader.done:
                return

    def _items(self) -> list[tuple[int, _CallReader]]:
        """Every call-shaped item so far: the value itself, or each element of a list."""
        items = []
        for at, reader in self._values:
            top = reader.span()
            if top is not None and top.kind == "array":
                i = 0
                while reader.span(i) is not None:
                    items.append((at, _CallReader(reader, (i,))))
                    i += 1
            elif top is not None:
                items.append((at, _CallReader(reader, ())))
        return items

    def _ready(self, final: bool) -> list[ToolEvent]:
        """Committed: the items finished since the last call, as calls (an item that is no call: its text);
        at the end, the last unfinished one too, and any text no item took."""
        items = self._items()
        self._committed = self._committed or any(call.committed for _, call in items)
        if not self._committed:
            return []
        body = self._buf[self._body_at:]
        events: list[ToolEvent] = []
        for at, call in items[self._sent:]:
            span = call.reader.span(*call.prefix)
            assert span is not None
            if span.end is None and not final:
                break
            parsed = call.call(body[at:] if span.end is None else body[at:at + span.end])
            if parsed is not None:
                events.append(ToolEvent(call=parsed))
            else:
                events.append(ToolEvent(text=body[at + span.start:at + (span.end or len(body) - at)]))
            self._sent += 1
            if span.end is None:
                return _coalesce(events)  # an unfinished item takes the rest of the output
        if final and items:
            at, reader = self._values[-1]
            rest = body[at + len(reader.text):] if reader.valid else body[at + len(reader.text) - 1:]
            if rest.strip(self.SEPARATORS):
                events.append(ToolEvent(text=rest))
        return _coalesce(events)

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

    @classmethod
    def calls_grammar(cls, calls: list[dict[str, Any]], parallel: bool, answer: dict[str, Any] | None = None) -> str:
        listed = {"type": "array", "items": one_of(calls), "minItems": 1, **({} if parallel else {"maxItems": 1})}
        if answer is None:
            return f"start: {json_rule(listed)}"
        return f"start: answer | calls\nanswer: {json_rule(answer)}\ncalls: {json_rule(listed)}"
