"""The Hermes / Qwen tool-call format: `<tool_call>{...}</tool_call>` blocks among text (see
renderers/tool_parsers.py for what a parser does)."""
from __future__ import annotations

import json
from typing import Any

from renderers.partial_json import JsonReader
from renderers.tool_parsers import (CallReader, ParsedToolCall, ToolEvent, ToolParser, choice_line, coalesce,
                                    json_rule, one_of, partial_suffix, register_tool_parser)


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
        self._call: CallReader | None = None  # inside: the body read as JSON (what is surely body)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    self._read_body(len(self._buf) - partial_suffix(self._buf, self.CLOSE))
                    return coalesce(events)
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
                self._call = CallReader(JsonReader(max_depth=1))
                continue
            keep = partial_suffix(self._buf, self.OPEN)
            events.append(self._text(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            return coalesce(events)

    def finish(self) -> list[ToolEvent]:
        if self._inside:
            self._read_body(len(self._buf))
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            return coalesce([self._call_or_text(buf, closed=False)])  # eos before the closing tag
        return coalesce([self._text(buf)])

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
                + choice_line(tool_choice))

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
