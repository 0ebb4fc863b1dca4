"""Qwen2 / Qwen2.5 (MODEL_TYPE=qwen2.5): ChatML turns and Hermes-style tool calls.

The model writes each call as <tool_call>{"name", "arguments"}</tool_call>, and reads tool results as
<tool_response> blocks in one user turn. Qwen2.5's own template handles `tools`; for a template that does
not (a GGUF's shortened one, Qwen2's), or none at all, this renderer writes the Qwen2.5 way: a default
system turn, the functions inside <tools></tools> in it, earlier calls as <tool_call> blocks."""
from __future__ import annotations

import json
from typing import Any

from renderers.basic import BasicRenderer
from renderers.registry import register_renderer

DEFAULT_SYSTEM = "You are a helpful assistant."
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@register_renderer("qwen2.5", "qwen2_5", "qwen2")
class Qwen25Renderer(BasicRenderer):
    name = "qwen2.5"
    default_tool_parser = "hermes"
    fallback_template = QWEN_TEMPLATE
    stop_tokens = ("<|im_end|>", "<|endoftext|>")

    def _tools_as_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       tool_choice: Any) -> list[dict[str, Any]]:
        out = super()._tools_as_text(messages, None, tool_choice)  # calls and results the Hermes way
        return with_system_text(out, tools_prompt(tools, tool_choice)) if tools else out


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` at the end of the system turn (Qwen's default one when there is none)."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{text}"}, *messages]


def tools_prompt(tools: list[dict[str, Any]], tool_choice: Any) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    must = ""
    if tool_choice == "required":
        must = "\nYou must call at least one function."
    elif isinstance(tool_choice, dict) and tool_choice.get("function", {}).get("name"):
        must = f"\nYou must call {tool_choice['function']['name']}."
    return ("# Tools\n\nYou may call one or more functions to help with the user's request. The functions "
            f"are listed inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\nFor each call, write a JSON "
            "object with the function's name and arguments inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' + must)
