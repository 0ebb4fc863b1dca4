"""Renderers by MODEL_TYPE: a new model family is one new file with @register_renderer."""
from __future__ import annotations

from collections.abc import Callable

from kvyard.tokenizer import TextTokenizer
from renderers.base import ChatRenderer

_RENDERERS: dict[str, type[ChatRenderer]] = {}


def register_renderer(*model_types: str) -> Callable[[type[ChatRenderer]], type[ChatRenderer]]:
    def wrap(cls: type[ChatRenderer]) -> type[ChatRenderer]:
        for model_type in model_types:
            if model_type in _RENDERERS:
                raise ValueError(f"a renderer is already registered for MODEL_TYPE {model_type!r}")
            _RENDERERS[model_type] = cls
        return cls
    return wrap


def get_renderer(model_type: str | None, tokenizer: TextTokenizer, tool_parser: str | None = None) -> ChatRenderer:
    """Selection: the renderer registered for MODEL_TYPE, else "default" (the model's own template).
    tool_parser (TOOL_CALL_PARSER) overrides the renderer's own tool-call format."""
    if model_type and model_type not in _RENDERERS:
        raise ValueError(f"no renderer for MODEL_TYPE {model_type!r}; known: {', '.join(sorted(_RENDERERS))}")
    return _RENDERERS[model_type or "default"](tokenizer, tool_parser)
