"""Gateway request → prefix keys, and each upstream's approximate prefix tree (SGLang router's idea).

Foreign upstreams report no cache, so the gateway remembers what it sent each one: the request's text,
rendered the same way every time (tools, then each message's role and text, or the prompt), cut into
blocks of `block_bytes` UTF-8 bytes with the engine's own chained keys (kvyard.block_keys). A chained
key names its block and everything before it, so a set of keys is a prefix tree; the leading run of a
request's keys an upstream holds is the prefix it most likely still has cached. Each upstream keeps the
most recently used `capacity` keys (the tree's LRU eviction), which only approximates its real cache.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Set
from typing import Any

from kvyard.block_keys import block_cache_keys


def request_text(body: dict[str, Any]) -> str:
    """The part of an OpenAI request an upstream's prompt starts with, in a stable order."""
    parts: list[str] = []
    for key in ("tools", "functions"):
        if body.get(key):
            parts.append(json.dumps(body[key], sort_keys=True, ensure_ascii=False))
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', '')}>{_text(m.get('content'))}")
    for key in ("prompt", "input"):  # completions; embeddings
        if key in body:
            parts.append(_text(body[key]))
    return "\n".join(parts)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts, or a batch of prompts
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) if isinstance(p, dict) else str(p)
                       for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def prefix_keys(text: str, model: str, block_bytes: int, max_bytes: int) -> list[int]:
    """Chained keys of the text's full blocks (the model name is part of every key)."""
    data = text.encode("utf-8", errors="surrogatepass")[:max_bytes]
    return block_cache_keys(list(data), block_bytes, model.encode())


class PrefixIndex(Set[int]):
    """One upstream's remembered block keys, least recently used first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def insert(self, keys: list[int]) -> None:
        """The upstream was sent a prompt with these keys: they are now its most recent."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
