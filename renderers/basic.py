"""The default renderer: the model's own jinja2 chat template, in a sandboxed environment."""
from __future__ import annotations

import json
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


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Refuse unsafe attribute access outright: with ChainableUndefined the sandbox's default (an
    undefined value that raises only when used) would print as "" and hide the attempt."""

    # `*` and `**` can build gigantic values from a few characters ('x' * 10**10): bound them.
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe.")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("exponent too large in a chat template")
            return left ** right
        if isinstance(left, (str, list, tuple)) or isinstance(right, (str, list, tuple)):
            seq, times = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(times, int) and len(seq) * times > MAX_TEMPLATE_VALUE:
                raise SecurityError("value too large in a chat template")
        return super().call_binop(context, operator, left, right)


# Templates may call json.dumps / json.loads; the module itself would expose codecs, re, sys... to them.
_TEMPLATE_JSON = SimpleNamespace(dumps=json.dumps, loads=json.loads)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
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


@register_renderer("default", "llama", "smollm2", "qwen_2", "mistral")
class BasicRenderer(ChatRenderer):
    name = "basic"

    def render(self, request: RenderRequest) -> RenderedPrompt:
        template, source = self._template(request)
        tok = self.tokenizer
        args: dict[str, Any] = {
            "messages": request.messages,
            "add_generation_prompt": request.add_generation_prompt,
            "bos_token": tok.bos_token or "",
            "eos_token": tok.eos_token or "",
            "json": _TEMPLATE_JSON,
        }
        if request.tools:
            args["tools"] = request.tools
        args.update(request.chat_template_kwargs)
        try:
            prompt = template.render(**args)
        except jinja2.exceptions.SecurityError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"template refused by the sandbox: {exc}",
                               "user_template") from exc
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"chat template failed: {exc}") from exc
        stop_words = [tok.eos_token] if tok.eos_token else []
        return RenderedPrompt(prompt=prompt, input_ids=tok.encode(prompt, parse_special=True),
                              stop_words=stop_words, renderer=self.name, template_source=source)

    def _template(self, request: RenderRequest) -> tuple[jinja2.Template, str]:
        if request.user_template is not None:
            if request.template_key is not None:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   "template_key and user_template can not be used together", "template_key")
            return compile_template(request.user_template), "user_template"
        if request.template_key is not None:
            named = self.tokenizer.chat_templates.get(request.template_key)
            if named is None:
                known = ", ".join(sorted(self.tokenizer.chat_templates)) or "none"
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"unknown template_key {request.template_key!r} (model has: {known})",
                                   "template_key")
            return compile_template(named), f"template_key:{request.template_key}"
        return compile_template(self.tokenizer.chat_template or FALLBACK_TEMPLATE), "model"
