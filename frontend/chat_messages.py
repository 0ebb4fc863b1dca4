"""The parts of a chat request body: messages (text and image parts, tool calls, the legacy function call)
and the tool definitions a request offers; and the strict base every request object shares."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    # Every request object names the fields it takes: any other is the client's 400 "Unrecognized request
    # argument supplied: <name>" (OpenAI's answer; docs/api.md#request-fields), never silently dropped.
    model_config = ConfigDict(extra="forbid")



class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str = Field(min_length=1)   # data:image/...;base64,..., http(s)://... or a file under IMAGE_FILE_ROOT
    # LLaVA-style towers see every image at their one, full resolution: "auto" and "high" are what they do; a
    # cheaper low-resolution view does not exist, so "low" is refused (frontend/chat.py), never ignored
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"   # OpenAI sends JSON text; some clients send the object


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]  # function: a legacy call's result
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # an earlier answer's reasoning (templates that show it use it)
    function_call: FunctionCall | None = None  # the deprecated form of tool_calls (the template sees it)
    # What the official client echoes back when a response's message is appended as it came
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None                     # audio answers are not served

    def text(self, image_placeholder: str = "") -> str:
        """The content as one text, each image part written as `image_placeholder`."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else image_placeholder for part in self.content)

    def image_urls(self) -> list[str]:
        return [] if not isinstance(self.content, list) else \
            [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the parameters are enforced whenever a call is forced (frontend/guided.py)


class ToolDefinition(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]   # {"name": ...}
