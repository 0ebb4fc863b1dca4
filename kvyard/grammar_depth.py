"""How deep a constraint's grammar nests, measured by loops (no recursion) before llguidance compiles it:
llguidance recurses as deep as the grammar nests and a deep one overflows the native stack, which kills
the process rather than raising (kvyard/limits.py has the bounds). kvyard/constraint.py calls these.

A recursive grammar (a schema whose tree $refs itself, a Lark rule that uses itself) is fine: llguidance
compiles the cycle once, so a reference back into the chain being measured adds nothing."""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any
from urllib.parse import unquote

_END = object()


def longest_chain(roots: Iterable[Hashable], children: Callable[[Any], Iterable[Hashable]], limit: int) -> int:
    """Nodes on the longest path from a root (edges back into the current path cut), or a number past
    `limit` as soon as one is seen. Iterative depth-first search with each node's height kept."""
    height: dict[Hashable, int] = {}
    for root in roots:
        if root in height:
            continue
        stack: list[list[Any]] = [[root, iter(children(root)), 0]]
        on_path = {root}
        while stack:
            top = stack[-1]
            child = next(top[1], _END)
            if child is _END:
                stack.pop()
                on_path.discard(top[0])
                height[top[0]] = top[2] + 1
                if height[top[0]] + len(stack) > limit:
                    return height[top[0]] + len(stack)
                if stack:
                    stack[-1][2] = max(stack[-1][2], height[top[0]])
            elif child in height:
                top[2] = max(top[2], height[child])
                if top[2] + len(stack) > limit:
                    return top[2] + len(stack)
            elif child not in on_path:
                if len(stack) >= limit:
                    return len(stack) + 1
                on_path.add(child)
                stack.append([child, iter(children(child)), 0])
    return max(height.values(), default=0)


def schema_depth(schema: Any, limit: int) -> int:
    """JSON levels of the schema's longest nesting, each local `$ref` ("#/$defs/a") continuing into its
    target. Containers are nodes (by identity: json.loads makes each one a distinct object)."""
    nodes: dict[int, Any] = {}

    def node(value: Any) -> int:
        nodes[id(value)] = value
        return id(value)

    def children(key: int) -> Iterable[int]:
        value = nodes[key]
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            if isinstance(item, (dict, list)):
                yield node(item)
        ref = value.get("$ref") if isinstance(value, dict) else None
        target = _resolve(schema, ref) if isinstance(ref, str) else None
        if isinstance(target, (dict, list)):
            yield node(target)

    if not isinstance(schema, (dict, list)):
        return 0
    return longest_chain([node(schema)], children, limit)


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer ("#", "#/$defs/a~1b"); None for any other reference."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    value = root
    for part in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINITION = re.compile(r"[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(\.-?\d+)?[ \t]*:")


def lark_depth(text: str, schema_limit: int, limit: int) -> tuple[int, int]:
    """(rules nested through one another, the deepest embedded `%json` schema's depth). A rule or terminal
    is defined by `name:` at the start of a line; every name in its body (outside strings, regexes,
    comments and embedded JSON) is an edge to that definition."""
    uses: dict[str, set[str]] = {}
    current: set[str] | None = None
    deepest_schema = 0
    i, n = 0, len(text)
    line_start = True
    while i < n:
        if line_start:
            line_start = False
            m = _DEFINITION.match(text, i)
            if m:
                current = uses.setdefault(m.group(1), set())
                i = m.end()
                continue
        c = text[i]
        if c == "\n":
            line_start = True
            i += 1
        elif c == '"':
            i = _skip_quoted(text, i, '"')
        elif c == "/":
            if text.startswith("//", i):
                j = text.find("\n", i)
                i = n if j < 0 else j
            else:
                i = _skip_quoted(text, i, "/")
        elif c == "%" and (text.startswith("%json", i) or text.startswith("%llguidance", i)):
            start = text.find("{", i)
            try:
                value, end = json.JSONDecoder().raw_decode(text, start)
            except json.JSONDecodeError:  # llguidance names the syntax error
                i += 1
                continue
            except RecursionError:  # nested deeper than Python's own limit: far past any budget
                return 0, schema_limit + 1
            if text.startswith("%json", i):
                deepest_schema = max(deepest_schema, schema_depth(value, schema_limit))
            i = end
        elif c.isalpha() or c == "_":
            m = _NAME.match(text, i)
            assert m is not None
            if current is not None:
                current.add(m.group(0))
            i = m.end()
        else:
            i += 1
    return longest_chain(list(uses), lambda name: (u for u in uses[name] if u in uses), limit), deepest_schema


def _skip_quoted(text: str, i: int, quote: str) -> int:
    """Past the literal opening at i (backslash escapes; a literal ends at its line's end at the latest)."""
    j = i + 1
    while j < len(text) and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return j + 1
