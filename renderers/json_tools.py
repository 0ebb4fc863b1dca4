"""The JSON tool-call format (Llama 3.1's JSON calls, Mistral's `[TOOL_CALLS]`): the whole output is one
or more call objects (see renderers/tool_parsers.py for what a parser does)."""
from __future__ import annotations

import json
from typing import Any

from renderers.partial_json import JsonReader
from renderers.tool_parsers import (CallReader, ParsedToolCall, ToolEvent, ToolParser, call_from_json, choice_line,
                                    coalesce, json_rule, one_of, register_tool_parser)


@register_tool_parser("json", "llama3_json")
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
            return coalesce([ToolEvent(text=text)])
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
                return coalesce([ToolEvent(text=buf)])
        self._read()
        return self._ready(final=False)

    def finish(self) -> list[ToolEvent]:
        if self._mode == "json":
            self._read()
            if self._committed:
                return self._ready(final=True)
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return coalesce([ToolEvent(text=buf)])
        calls = self._calls(buf)
        return [ToolEvent(call=c) for c in calls] if calls else coalesce([ToolEvent(text=buf)])

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

    def _items(self) -> list[tuple[int, CallReader]]:
        """Every call-shaped item so far: the value itself, or each element of a list."""
        items = []
        for at, reader in self._values:
            top = reader.span()
            if top is not None and top.kind == "array":
                i = 0
                while reader.span(i) is not None:
                    items.append((at, CallReader(reader, (i,))))
                    i += 1
            elif top is not None:
                items.append((at, CallReader(reader, ())))
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
                return coalesce(events)  # an unfinished item takes the rest of the output
        if final and items:
            at, reader = self._values[-1]
            rest = body[at + len(reader.text):] if reader.valid else body[at + len(reader.text) - 1:]
            if rest.strip(self.SEPARATORS):
                events.append(ToolEvent(text=rest))
        return coalesce(events)

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
                "<arguments-json-object>}, ...]. Otherwise answer normally." + choice_line(tool_choice))

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        return json.dumps(calls, ensure_ascii=False)

    @classmethod
    def calls_grammar(cls, calls: list[dict[str, Any]], parallel: bool, answer: dict[str, Any] | None = None) -> str:
        listed = {"type": "array", "items": one_of(calls), "minItems": 1, **({} if parallel else {"maxItems": 1})}
        if answer is None:
            return f"start: {json_rule(listed)}"
        return f"start: answer | calls\nanswer: {json_rule(answer)}\ncalls: {json_rule(listed)}"
