"""Chat renderers: messages → prompt string, by MODEL_TYPE (see renderers/registry.py)."""
from renderers.base import ChatRenderer, RenderedPrompt, RenderRequest
from renderers.registry import get_renderer, register_renderer
import renderers.basic  # noqa: F401  (registers "default")

__all__ = ["ChatRenderer", "RenderedPrompt", "RenderRequest", "get_renderer", "register_renderer"]
