"""The default renderer: the model's own jinja2 chat template, in a sandboxed environment."""
from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from kvyard.errors import ErrorCode, RequestError
from renderers.base import ChatRenderer, RenderedPrompt, RenderRequest
from renderers.registry import register_renderer

# Used when a tokenizer ships no template at all (ChatML, which SmolLM2 and Qwen use).
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


MAX_TEMPLATE_VALUE = 1_000_000  # characters or items one `*` may build
RENDER_TIME_LIMIT_S = 2.0       # one render, every loop and macro call included
MAX_RENDERED_CHARS = 16_000_000  # what one render may write (a loop can repeat a big value cheaply)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Refuse unsafe attribute access outright: with ChainableUndefined the sandbox's default (an
    undefined value that raises only when used) would print as "" and hide the attempt."""

    # `*` and `**` can build gigantic values from a few characters ('x' * 10**10), and so can a printf
    # width ('%999999999s' % x): bound them.
    intercepted_binops = frozenset({"*", "**", "%"})

    def wrap_str_format(self, value: Any) -> Any:
        """str.format / format_map as the sandbox wraps them, with the widths in the string bounded."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_widths(_FORMAT_SPEC.findall(value.__self__))
        return wrapped

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe.")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%" and isinstance(left, str):
            _check_widths(_PRINTF_SPEC.findall(left))
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("exponent too large in a chat template")
            return left ** right
        if isinstance(left, (str, list, tuple)) or isinstance(right, (str, list, tuple)):
            seq, times = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(times, int) and len(seq) * times > MAX_TEMPLATE_VALUE:
                raise SecurityError("value too large in a chat template")
        return super().call_binop(context, operator, left, right)


class _OverBudget(Exception):
    pass


def render_bounded(template: jinja2.Template, args: dict[str, Any]) -> str:
    """template.render(**args) with a work budget: nested loops over range() or a long string, or a
    self-calling macro, end in a 400 instead of holding a thread (and the GIL) for minutes. Compiled
    templates are Python code named "<template>": a trace function on this thread counts their lines
    and checks the clock every 1024 of them; the output is counted as it is produced."""
    time_limit_s, max_chars = RENDER_TIME_LIMIT_S, MAX_RENDERED_CHARS
    deadline = time.monotonic() + time_limit_s
    lines = 0

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if not lines & 1023 and time.monotonic() > deadline:
                raise _OverBudget(f"the chat template ran past its {time_limit_s:g} s budget")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts, size = [], 0
        for part in template.generate(**args):
            size += len(part)
            if size > max_chars:
                raise _OverBudget(f"the chat template wrote more than {max_chars} characters")
            parts.append(part)
        return "".join(parts)
    except RecursionError:
        raise _OverBudget("the chat template recursed too deeply") from None
    finally:
        sys.settrace(previous)


_PRINTF_SPEC = re.compile(r"%[^a-zA-Z%]*[a-zA-Z%]")
_FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")
_NUMBER = re.compile(r"\d+")


def _check_widths(specs: list[str]) -> None:
    """Widths and precisions in format specs ('%9999999s', '{:>9999999}') must stay small."""
    if any(int(n) > MAX_TEMPLATE_VALUE for spec in specs for n in _NUMBER.findall(spec)):
        raise SecurityError("format width too large in a chat template")


def _bounded_filter(name: str, *positions: int) -> Any:
    """Jinja's filter `name`, refusing sizes (the arguments at `positions`) past MAX_TEMPLATE_VALUE."""
    inner = jinja2.defaults.DEFAULT_FILTERS[name]

    def bounded(value: Any, *args: Any, **kwargs: Any) -> Any:
        sizes = [args[i - 1] for i in positions if len(args) >= i] + \
                [v for k, v in kwargs.items() if k in ("width", "length")]
        if any(isinstance(n, int) and abs(n) > MAX_TEMPLATE_VALUE for n in sizes):
            raise SecurityError(f"{name} width too large in a chat template")
        if name == "format" and isinstance(value, str):
            _check_widths(_PRINTF_SPEC.findall(value))
        return inner(value, *args, **kwargs)
    return bounded


def _tojson(value: Any, indent: Any = None) -> str:
    if isinstance(indent, int) and abs(indent) > 64:
        raise SecurityError("tojson indent too large in a chat template")
    return json.dumps(value, ensure_ascii=False, indent=indent)


# Templates may call json.dumps / json.loads; the module itself would expose codecs, re, sys... to them.
_TEMPLATE_JSON = SimpleNamespace(dumps=json.dumps, loads=json.loads)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
    env.filters["tojson"] = _tojson
    for name, positions in (("center", (1,)), ("indent", (1,)), ("wordwrap", (1,)), ("truncate", (1,)),
                            ("format", ())):
        env.filters[name] = _bounded_filter(name, *positions)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"chat template does not compile: {exc}",
                           "user_template") from exc


TOOL_USE_TEMPLATE_KEY = "tool_use"   # the named template HF models ship for requests with tools
_MENTIONS_TOOLS = re.compile(r"\btools\b")


@register_renderer("default", "llama", "smollm2", "qwen_2")
class BasicRenderer(ChatRenderer):
    """The model's jinja2 template, chosen in this order (the first that applies):
    1. the request's `user_template` (sandboxed; with `template_key` as well it is a 400),
    2. the request's `template_key`: a named template the model ships (unknown name: 400),
    3. with tools, the model's "tool_use" named template when it ships one,
    4. the model's default template,
    5. ChatML (FALLBACK_TEMPLATE) when the model ships none.
    Tools: a template that mentions `tools` gets them as the variable `tools`; for one that does not,
    the tool parser's text describing them goes into the system prompt, earlier calls are written the way
    the model writes them, and tool results become user turns (ToolParser.format_result)."""
    name = "basic"
    fallback_template = FALLBACK_TEMPLATE  # when the model ships no template: the family's turn format
    stop_tokens: tuple[str, ...] = ()  # the family's end-of-turn tokens (stop strings where the vocabulary has them)
    template_handles_tools = True      # a template that mentions `tools` gets them (False: always as text)
    format_stops: tuple[str, ...] = ()  # text of the tool-call format that ends the answer (RenderedPrompt's)

    def render(self, request: RenderRequest) -> RenderedPrompt:
        template, source, template_text = self._template(request)
        tok = self.tokenizer
        messages = request.messages
        in_prompt = False
        args: dict[str, Any] = {
            "add_generation_prompt": request.add_generation_prompt,
            "bos_token": "", "eos_token": "",   # templates concatenate them, so never undefined
            **tok.special_tokens_map,           # bos, eos, unk, pad, ... and additional_special_tokens
            "json": _TEMPLATE_JSON,
        }
        if self.template_handles_tools and _MENTIONS_TOOLS.search(template_text):
            messages = [_arguments_as_objects(m) for m in messages]
            if request.tools:
                args["tools"] = request.tools
        elif request.tools or any(m.get("tool_calls") or m.get("function_call") or m.get("role") in ("tool", "function")
                                  for m in messages):
            messages = self._tools_as_text(messages, request.tools, request.tool_choice)
            in_prompt = bool(request.tools)
        args["messages"] = messages
        if request.functions:  # a legacy request: templates written for it read `functions`
            args["functions"] = request.functions
        args.update(request.chat_template_kwargs)
        try:
            prompt = render_bounded(template, args)
        except _OverBudget as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "user_template") from exc
        except jinja2.exceptions.SecurityError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"template refused by the sandbox: {exc}",
                               "user_template") from exc
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a template raises is the template's failure
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"chat template failed: {type(exc).__name__}: {exc}"
                               ) from exc
        stop_words = self.stop_words()
        return RenderedPrompt(prompt=prompt, input_ids=tok.encode(prompt, parse_special=True),
                              stop_words=stop_words, renderer=self.name, template_source=source,
                              tools_in_prompt=in_prompt, format_stops=self.format_stops)

    def stop_words(self) -> list[str]:
        """Strings that end the answer (the backend stops on the ids too): the family's end-of-turn tokens
        this vocabulary has, else the eos token."""
        known = [t for t in self.stop_tokens if self.tokenizer.token_id(t) is not None]
        return known or ([self.tokenizer.eos_token] if self.tokenizer.eos_token else [])

    def _template(self, request: RenderRequest) -> tuple[jinja2.Template, str, str]:
        named = self.tokenizer.chat_templates
        if request.user_template is not None:
            if request.template_key is not None:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   "template_key and user_template can not be used together", "template_key")
            return compile_template(request.user_template), "user_template", request.user_template
        if request.template_key is not None:
            if request.template_key not in named:
                known = ", ".join(sorted(named)) or "none"
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"unknown template_key {request.template_key!r} (model has: {known})",
                                   "template_key")
            text = named[request.template_key]
            return compile_template(text), f"template_key:{request.template_key}", text
        if request.tools and TOOL_USE_TEMPLATE_KEY in named:
            text = named[TOOL_USE_TEMPLATE_KEY]
            return compile_template(text), f"template_key:{TOOL_USE_TEMPLATE_KEY}", text
        if self.tokenizer.chat_template:
            return compile_template(self.tokenizer.chat_template), "model", self.tokenizer.chat_template
        return compile_template(self.fallback_template), "fallback", self.fallback_template

    def _tools_as_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       tool_choice: Any) -> list[dict[str, Any]]:
        parser = self.tool_parser
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.get("role") == "tool":
                text = parser.format_result(m.get("content") or "")
                if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
                else:
                    out.append({"role": "user", "content": text, "_tool_results": True})
            elif m.get("tool_calls"):
                calls = [_call_object(c) for c in m["tool_calls"]]
                content = "\n".join(p for p in (m.get("content") or "", parser.format_calls(calls)) if p)
                out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": content})
            else:
                out.append(m)
        out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
        if tools:
            prompt = parser.tools_prompt(tools, tool_choice)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call → {"name", "arguments": object} (arguments parsed when they are JSON text)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {"name": fn.get("name", ""), "arguments": args}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """HF templates index tool_call.function.arguments as a mapping; OpenAI sends it as JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        obj = _call_object(c)
        calls.append({**c, "function": {"name": obj["name"], "arguments": obj["arguments"]}})
    return {**message, "tool_calls": calls}
