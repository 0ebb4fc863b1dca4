"""Reading SSE bodies in tests."""
from __future__ import annotations


def sse_data(text: str) -> list[str]:
    """The payloads of an SSE body's `data:` lines, in order (space after the colon optional)."""
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("data:")]
