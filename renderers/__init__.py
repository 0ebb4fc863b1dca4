"""Chat renderers: messages → prompt string, by MODEL_TYPE (see renderers/registry.py)."""
from renderers.base import ChatRenderer, RenderedPrompt, RenderRequest
from renderers.registry import get_renderer, register_renderer
from renderers.tool_parsers import ParsedToolCall, ToolEvent, ToolParser, get_tool_parser, register_tool_parser
import renderers.basic  # noqa: F401  (registers "default")
import renderers.hermes_tools  # noqa: F401  (registers the "hermes"/"qwen" tool-call format)
import renderers.json_tools  # noqa: F401  (registers "json"/"llama3_json")
import renderers.llama3  # noqa: F401  (registers "llama3")
import renderers.mistral  # noqa: F401  (registers "mistral", renderer and tool parser)
import renderers.qwen2  # noqa: F401  (registers "qwen2.5")
import renderers.qwen_agent  # noqa: F401  (registers "qwen_agent", renderer and tool parser)

__all__ = ["ChatRenderer", "ParsedToolCall", "RenderedPrompt", "RenderRequest", "ToolEvent", "ToolParser",
           "get_renderer", "get_tool_parser", "register_renderer", "register_tool_parser"]
