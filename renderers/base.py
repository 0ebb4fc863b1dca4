"""The renderer interface: the frontend's render stage between the HTTP request and tokenization."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvyard.tokenizer import TextTokenizer


@dataclass
class RenderRequest:
    """What a renderer needs from a chat request, independent of the HTTP schema."""
    messages: list[dict[str, Any]]            # OpenAI messages, content flattened to text
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    template_key: str | None = None           # pick a named template the model ships
    user_template: str | None = None          # a caller-supplied jinja2 template (sandboxed)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RenderedPrompt:
    prompt: str                 # the exact string given to the tokenizer
    input_ids: list[int]        # the prompt tokenized with special tokens parsed
    stop_words: list[str]       # strings that end generation for this model/template
    renderer: str               # which renderer produced it (for /chat/render)
    template_source: str        # "model", "user_template" or "template_key:<name>"


class ChatRenderer(ABC):
    name = "abstract"

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def render(self, request: RenderRequest) -> RenderedPrompt:
        """Raises RequestError(INVALID_ARGUMENT) for a template the request cannot use."""
