"""Renderers by MODEL_TYPE: a new model family is one new file with @register_renderer."""
from __future__ import annotations

from kvyard.tokenizer import TextTokenizer
from renderers.base import ChatRenderer
from renderers.named import Named

_RENDERERS: Named[type[ChatRenderer]] = Named("renderer for MODEL_TYPE")
register_renderer = _RENDERERS.register


def get_renderer(model_type: str | None, tokenizer: TextTokenizer, tool_parser: str | None = None) -> ChatRenderer:
    """Selection: the renderer registered for MODEL_TYPE, else "default" (the model's own template).
    tool_parser (TOOL_CALL_PARSER) overrides the renderer's own tool-call format."""
    return _RENDERERS.get(model_type or "default")(tokenizer, tool_parser)
