"""The renderer interface: the frontend's render stage between the HTTP request and tokenization."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvyard.tokenizer import TextTokenizer
from renderers.response_stream import PlainText, ResponseStream, ToolCallStream
from renderers.tool_parsers import ToolParser, get_tool_parser


@dataclass
class RenderRequest:
    """What a renderer needs from a chat request, independent of the HTTP schema."""
    messages: list[dict[str, Any]]            # OpenAI messages, content flattened to text
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions the model may call
    tool_choice: Any = None                     # "auto" / "required" / {"type": "function", ...}
    template_key: str | None = None           # pick a named template the model ships
    user_template: str | None = None          # a caller-supplied jinja2 template (sandboxed)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    functions: list[dict[str, Any]] | None = None  # the legacy `functions`, as templates read them (RTP-LLM's)


@dataclass
class RenderedPrompt:
    prompt: str                 # the exact string given to the tokenizer
    input_ids: list[int]        # the prompt tokenized with special tokens parsed
    stop_words: list[str]       # strings that end generation for this model/template
    renderer: str               # which renderer produced it (for /chat/render)
    template_source: str        # "model", "user_template", "template_key:<name>" or "fallback"
    tools_in_prompt: bool = False  # tool definitions were written into the system prompt by us
    format_stops: tuple[str, ...] = ()  # markers of the renderer's format that end the answer (stop strings)


class ChatRenderer(ABC):
    name = "abstract"
    default_tool_parser = "hermes"   # the tool-call format this model family writes

    def __init__(self, tokenizer: TextTokenizer, tool_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_parser: type[ToolParser] = get_tool_parser(tool_parser or self.default_tool_parser)

    @abstractmethod
    def render(self, request: RenderRequest) -> RenderedPrompt:
        """Raises RequestError(INVALID_ARGUMENT) for a template the request cannot use."""

    def render_response_stream(self, tools_offered: bool) -> ResponseStream:
        """One choice's output post-processing (RTP-LLM's hook of this name; renderers/response_stream.py),
        streamed or whole: the tool parser's calls when the request offers tools, else the text as it is."""
        return ToolCallStream(self.tool_parser()) if tools_offered else PlainText()
