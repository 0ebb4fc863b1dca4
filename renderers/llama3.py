"""Llama 3.x (MODEL_TYPE=llama3): its header turn format, and tool calls the way Llama 3.1 makes them.

The model answers a call as one JSON object {"name", "parameters"} (after <|python_tag|> when it uses
its built-in tools), ending the turn with <|eom_id|> instead of <|eot_id|>; a tool's result comes back
in an `ipython` turn. A template that handles `tools` itself (Llama 3.1's own) gets them as the variable;
for one that does not (Llama 3.0's, 3.2 GGUFs' shortened ones) this renderer writes the functions into
the system turn, earlier calls as that JSON, and results as ipython turns."""
from __future__ import annotations

import json
from typing import Any

from renderers.basic import BasicRenderer, _call_object
from renderers.registry import register_renderer

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@register_renderer("llama3", "llama3.1", "llama3.2")
class Llama3Renderer(BasicRenderer):
    name = "llama3"
    default_tool_parser = "llama3_json"
    fallback_template = LLAMA3_TEMPLATE
    stop_tokens = ("<|eot_id|>", "<|eom_id|>")

    def _tools_as_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       tool_choice: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.get("role") == "tool":
                out.append({"role": "ipython", "content": m.get("content") or ""})
            elif m.get("tool_calls"):
                calls = [_call_object(c) for c in m["tool_calls"]]
                text = "\n".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                                 for c in calls)
                out.append({**{k: v for k, v in m.items() if k != "tool_calls"},
                            "content": "\n".join(p for p in (m.get("content") or "", text) if p)})
            else:
                out.append(m)
        if tools:
            prompt = tools_prompt(tools, tool_choice)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out


def tools_prompt(tools: list[dict[str, Any]], tool_choice: Any) -> str:
    functions = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=2) for t in tools)
    must = ""
    if tool_choice == "required":
        must = " You must call one of them."
    elif isinstance(tool_choice, dict) and tool_choice.get("function", {}).get("name"):
        must = f" You must call {tool_choice['function']['name']}."
    return ("You can call these functions. To call one, answer with only a JSON object "
            '{"name": <function name>, "parameters": <an object of argument names and values>}, '
            f"nothing else; otherwise answer normally.{must}\n\n{functions}")
