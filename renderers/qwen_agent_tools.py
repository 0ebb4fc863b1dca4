"""Qwen-Agent's function-call format (TOOL_CALL_PARSER=qwen_agent; the qwen_agent renderer's own): a call is
two lines in the answer, `✿FUNCTION✿: <name>` then `✿ARGS✿: <input>`; the tool's result comes back as
`✿RESULT✿: <result>` and the model goes on after `✿RETURN✿:` (renderers/qwen_agent.py writes those). See
renderers/tool_parsers.py for what a parser does."""
from __future__ import annotations

import json
from typing import Any

from renderers.tool_parsers import (ParsedToolCall, ToolEvent, ToolParser, choice_line, coalesce, json_rule,
                                    partial_suffix, register_tool_parser)

FUNCTION, ARGS, RESULT, RETURN = "✿FUNCTION✿", "✿ARGS✿", "✿RESULT✿", "✿RETURN✿"
STOP_MARKERS = (RESULT, RETURN)   # the model writes these only to imagine a result: the answer ends there
_CALL = f"{FUNCTION}:"            # where a call starts
_ARGS = f"\n{ARGS}:"              # the name line ends with the arguments' marker


@register_tool_parser("qwen_agent")
class QwenAgentToolParser(ToolParser):
    """Text, then calls: `✿FUNCTION✿: name` `\\n✿ARGS✿: input`, one after another. A call is decided once
    its name line is complete; its input runs to the next `✿FUNCTION✿:`, a `✿RESULT✿` / `✿RETURN✿` (after
    which nothing more is read: the model would be inventing the result) or the end, and is passed on as
    written (stripped), as Qwen-Agent does: usually JSON, but a tool may take other text. A name line that
    is empty or not followed by `✿ARGS✿:` stays text."""
    name = "qwen_agent"

    def __init__(self) -> None:
        self._buf = ""
        self._state = "text"   # → "name" (after ✿FUNCTION✿:), "args" (a decided call), "done"
        self._name = ""        # args: the call's name

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while True:
            if self._state == "done":
                self._buf = ""
                return coalesce(events)
            if self._state == "text":
                start = self._buf.find(_CALL)
                if start < 0:
                    keep = partial_suffix(self._buf, _CALL)
                    events.append(ToolEvent(text=self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return coalesce(events)
                events.append(ToolEvent(text=self._buf[:start]))
                self._buf, self._state = self._buf[start + len(_CALL):], "name"
            elif self._state == "name":
                decided = self._name_line()
                if decided is None:
                    return coalesce(events)
                if not decided:  # not a call after all: its marker is text, and the search goes on after it
                    events.append(ToolEvent(text=_CALL))
                    self._state = "text"
            else:
                end, marker = self._args_end()
                if end < 0:
                    return coalesce(events)
                events.append(ToolEvent(call=ParsedToolCall(self._name, self._buf[:end].strip())))
                self._buf = self._buf[end + len(marker):]
                self._state = "name" if marker == _CALL else "done"

    def finish(self) -> list[ToolEvent]:
        buf, self._buf = self._buf, ""
        state, self._state = self._state, "done"
        if state == "text":
            return coalesce([ToolEvent(text=buf)])
        if state == "name":  # the output ended inside a name line: it was not a call
            return coalesce([ToolEvent(text=_CALL + buf)])
        if state == "args":
            return [ToolEvent(call=ParsedToolCall(self._name, buf.strip()))]
        return []

    def pending(self) -> ParsedToolCall | None:
        if self._state != "args":
            return None
        held = max(partial_suffix(self._buf, m) for m in (_CALL, *STOP_MARKERS))
        # Stripped on both sides, so it stays a prefix of the finished call's (stripped) input.
        return ParsedToolCall(self._name, self._buf[:len(self._buf) - held].strip())

    def _name_line(self) -> bool | None:
        """In a name line: True once it is decided as a call (state → args), False when it is not one,
        None while undecided."""
        newline = self._buf.find("\n")
        if newline < 0:
            return None
        rest = self._buf[newline:]
        if not rest.startswith(_ARGS):
            return None if _ARGS.startswith(rest) else False
        name = self._buf[:newline].strip()
        if not name:
            return False
        self._name, self._buf, self._state = name, rest[len(_ARGS):], "args"
        return True

    def _args_end(self) -> tuple[int, str]:
        """Where the call's input ends in the buffer, and the marker that ends it ((-1, "") if none yet)."""
        found = [(i, m) for m in (_CALL, *STOP_MARKERS) if (i := self._buf.find(m)) >= 0]
        return min(found) if found else (-1, "")

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]], tool_choice: Any) -> str:
        functions = [t.get("function", t) for t in tools]
        described = "\n\n".join(
            f"### {f['name']}\n\n{f['name']}: {f.get('description') or ''} Parameters: "
            f"{json.dumps(f.get('parameters') or {}, ensure_ascii=False)} Give the input as a JSON object."
            for f in functions)
        names = ",".join(f["name"] for f in functions)
        return (f"# Tools\n\n## The tools you can use\n\n{described}\n\n## How to use a tool\n\n"
                "Put these lines in your reply, as many times as you need a tool (or never):\n\n"
                f"{FUNCTION}: the tool's name, one of [{names}]\n{ARGS}: the tool's input\n"
                f"{RESULT}: what the tool returned\n{RETURN}: your reply, from what the tools returned"
                + choice_line(tool_choice))

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{FUNCTION}: {c['name']}\n{ARGS}: {_input_text(c.get('arguments'))}" for c in calls)

    @classmethod
    def format_result(cls, content: str) -> str:
        return f"{RESULT}: {content}"

    @classmethod
    def calls_grammar(cls, calls: list[dict[str, Any]], parallel: bool, answer: dict[str, Any] | None = None) -> str:
        # One alternative per function: its name written out, then JSON arguments that follow its schema.
        heads = [_literal(f"{FUNCTION}: {c['properties']['name']['const']}\n{ARGS}: ") for c in calls]
        alternatives = [f"call_{i}: {head} {json_rule(c['properties']['arguments'])}"
                        for i, (head, c) in enumerate(zip(heads, calls))]
        rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(calls))), *alternatives,
                 'calls: call ("\\n" call)*' if parallel else "calls: call"]
        if answer is None:
            return "\n".join(["start: calls", *rules])
        return "\n".join(["start: answer | calls", f"answer: {json_rule(answer)}", *rules])


def _input_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
