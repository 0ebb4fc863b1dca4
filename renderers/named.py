"""Classes by name, registered with a decorator: MODEL_TYPE renderers and TOOL_CALL_PARSER formats."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Named(Generic[T]):
    """`@named.register("a", "b")` files a class under each name; `named.get(name)` finds it, and an unknown
    name is a ValueError that lists the known ones (the launcher prints it as its one error line)."""

    def __init__(self, what: str) -> None:
        self.what = what                  # e.g. "renderer for MODEL_TYPE", "tool parser"
        self._classes: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        def wrap(cls: T) -> T:
            for name in names:
                if name in self._classes:
                    raise ValueError(f"a {self.what} is already registered as {name!r}")
                self._classes[name] = cls
            return cls
        return wrap

    def get(self, name: str) -> T:
        if name not in self._classes:
            raise ValueError(f"no {self.what} {name!r}; known: {', '.join(sorted(self._classes))}")
        return self._classes[name]
