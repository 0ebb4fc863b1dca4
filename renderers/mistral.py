"""MODEL_TYPE=mistral: Mistral Instruct's `[INST]` turns and its function-calling format (the v3 tokenizer's):
the tools listed in `[AVAILABLE_TOOLS]`, calls written `[TOOL_CALLS] [{"name", "arguments"}, ...]`, results
in `[TOOL_RESULTS]`. A model template that takes `tools` gets them as they are; for one that does not, the
base renderer writes them as text in this format. The answer's calls are read by the "mistral" parser."""
from __future__ import annotations

import json
from typing import Any

from renderers.basic import BasicRenderer
from renderers.json_tools import JsonToolParser
from renderers.registry import register_renderer
from renderers.tool_parsers import choice_line, register_tool_parser

# Mistral's turns; a system message goes in front of the next user turn (Mistral has no system turn).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] ~ '\\n\\n' %}"
    "{% elif m['role'] == 'user' %}[INST] {{ ns.system }}{{ m['content'] }}[/INST]{% set ns.system = '' %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


@register_tool_parser("mistral")
class MistralToolParser(JsonToolParser):
    """Reads calls as the JSON parser does (with or without the `[TOOL_CALLS]` prefix); writes the tools,
    earlier calls and results the way Mistral's models were trained to see them."""
    name = "mistral"

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]], tool_choice: Any) -> str:
        return ("[AVAILABLE_TOOLS] " + json.dumps(tools, ensure_ascii=False) + "[/AVAILABLE_TOOLS]\n"
                'To call functions, answer with [TOOL_CALLS] and a JSON list: [{"name": <function-name>, '
                '"arguments": <arguments-json-object>}, ...]. Otherwise answer normally.' + choice_line(tool_choice))

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "[TOOL_CALLS] " + json.dumps(calls, ensure_ascii=False)

    @classmethod
    def format_result(cls, content: str) -> str:
        return "[TOOL_RESULTS] " + json.dumps({"content": content}, ensure_ascii=False) + "[/TOOL_RESULTS]"


@register_renderer("mistral")
class MistralRenderer(BasicRenderer):
    name = "mistral"
    default_tool_parser = "mistral"
    fallback_template = MISTRAL_TEMPLATE
