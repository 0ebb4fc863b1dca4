"""MODEL_TYPE=qwen_agent (RTP-LLM's renderer of that name): Qwen's ChatML turns, with tools in Qwen-Agent's
function-call format (renderers/qwen_agent_tools.py) whatever the model's template says of tools.

The tools are described in the system turn. An earlier call is written into its assistant turn as
`✿FUNCTION✿: name` / `✿ARGS✿: input`; each result follows it in the same turn as `✿RESULT✿: result`, then
`✿RETURN✿`, and the model's reply after the results continues that turn. When the conversation ends on
results, the assistant turn holding them is joined to the user turn before it (Qwen-Agent's way of having
the model continue it), so the model's answer starts with the `:` of `✿RETURN✿:`, which the output
post-processing (render_response_stream) takes off again. `✿RESULT✿` and `✿RETURN✿` stop the answer."""
from __future__ import annotations

from typing import Any

from renderers.basic import _call_object
from renderers.qwen2 import Qwen25Renderer, with_system_text
from renderers.qwen_agent_tools import RESULT, RETURN, STOP_MARKERS
from renderers.registry import register_renderer
from renderers.response_stream import Delta, ResponseStream, ToolCallStream
from renderers.tool_parsers import ToolParser

_AWAITING_REPLY = f"\n{RETURN}: "   # the end of an assistant turn whose results the model has not answered


@register_renderer("qwen_agent")
class QwenAgentRenderer(Qwen25Renderer):
    name = "qwen_agent"
    default_tool_parser = "qwen_agent"
    template_handles_tools = False   # tools are always written in Qwen-Agent's format
    format_stops = STOP_MARKERS

    def _tools_as_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       tool_choice: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            role = m.get("role")
            if role in ("tool", "function"):
                result = f"\n{RESULT}: {m.get('content') or ''}{_AWAITING_REPLY}"
                if out and out[-1]["role"] == "assistant":  # several results in a row: one reply after them all
                    out[-1] = {**out[-1], "content": out[-1]["content"].removesuffix(_AWAITING_REPLY) + result}
                else:
                    out.append({"role": "assistant", "content": result.lstrip("\n")})
                continue
            if role != "assistant":
                out.append(m)
                continue
            calls = [_call_object(c) for c in m.get("tool_calls") or []]
            if not calls and m.get("function_call"):
                calls = [_call_object(m["function_call"])]
            content = "\n".join(p for p in (m.get("content") or "", self.tool_parser.format_calls(calls)) if p)
            if out and out[-1]["role"] == "assistant":  # the reply (or more calls) after results: the same turn
                previous = out[-1]["content"]
                joined = previous + content if previous.endswith(_AWAITING_REPLY) else f"{previous}\n{content}"
                out[-1] = {**out[-1], "content": joined}
            else:
                out.append({k: v for k, v in m.items() if k not in ("tool_calls", "function_call")}
                           | {"content": content})
        if len(out) >= 2 and out[-1]["role"] == "assistant" and out[-1]["content"].endswith(_AWAITING_REPLY) \
                and out[-2]["role"] == "user":
            turn = out.pop()["content"].removesuffix(": ")
            out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{turn}"}
        return with_system_text(out, self.tool_parser.tools_prompt(tools, tool_choice)) if tools else out

    def render_response_stream(self, tools_offered: bool) -> ResponseStream:
        return _AfterReturn(self.tool_parser()) if tools_offered else super().render_response_stream(False)


class _AfterReturn(ToolCallStream):
    """An answer that continues `✿RETURN✿` starts with its `:` (or `: `): taken off before the parser reads it."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._head: str | None = ""   # the answer's first characters while undecided (None: decided)

    def feed(self, text: str) -> list[Delta]:
        if self._head is not None:
            self._head += text
            if self._head in ("", ":"):
                return []
            text, self._head = _without_colon(self._head), None
        return super().feed(text)

    def finish(self) -> list[Delta]:
        head, self._head = self._head, None
        return (super().feed(_without_colon(head)) if head else []) + super().finish()


def _without_colon(text: str) -> str:
    return text[2:] if text.startswith(": ") else text[1:] if text.startswith(":") else text
