"""Request fields → the one Constraint the output must follow (after validation, before the backend call).

Sources, at most one per request: OpenAI's `response_format` (`json_object`, `json_schema` with `strict`),
vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, llama.cpp's `grammar` (GBNF)
and `json_schema`, and, for chat, `tool_choice` "required" or a named function, which forces the model's
tool-call format around the functions' parameter schemas (renderers/tool_parsers.py writes that grammar).
Every constraint is checked here with llguidance (`check`, on the frontend's grammar pool, not the
preparation threads: frontend/off_loop.py): a bad schema or grammar is a 400 naming the problem, before
the backend is called.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any

from frontend.off_loop import off_loop_grammar
from frontend.protocol import ChatCompletionRequest, GuidedDecoding, NamedToolChoice
from kvyard.constraint import JSON_STYLE, Constraint, ConstraintKind, check_schema_depth
from kvyard.errors import ErrorCode, RequestError
from renderers import ToolParser

# Every field that asks for a constraint. Dialects that take none (/generate, LMTP) refuse them rather
# than answer unconstrained text.
CONSTRAINT_FIELDS = frozenset(GuidedDecoding.model_fields)

# Where a JSON schema nests schemas (everything else in it is data or annotations).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_SCHEMA_VALUES = frozenset({"items", "additionalProperties", "additionalItems", "contains", "not", "if", "then",
                            "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems"})


def constraint_for(req: GuidedDecoding) -> Constraint | None:
    """The request's own constraint (no tools involved); raises RequestError(INVALID_ARGUMENT)."""
    given = _given(req)
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{' and '.join(given)} are alternatives: give one", given[1])
    param = given[0]
    try:
        constraint = _build(req, param)
    except RequestError as exc:
        raise RequestError(exc.code, exc.message if exc.param else f"{param}: {exc.message}", exc.param or param) from None
    return constraint


async def check(constraint: Constraint | None, req: GuidedDecoding) -> None:
    """llguidance's verdict on the constraint built for `req`, on the grammar pool within its time budget;
    raises RequestError naming the field."""
    if constraint is not None:
        param = "tools" if constraint.kind is ConstraintKind.LARK and _forces_tools(req) else _given(req)[0]
        await off_loop_grammar(functools.partial(_check, constraint, param))


def _forces_tools(req: GuidedDecoding) -> bool:
    """The constraint is the tool-call grammar (chat_constraint): tools in use and forced, or beside a
    response format."""
    tools = req.tools_in_use() if isinstance(req, ChatCompletionRequest) else None
    return bool(tools)


def chat_constraint(req: ChatCompletionRequest, parser: type[ToolParser]) -> Constraint | None:
    """A chat request's constraint: its own (constraint_for), the forced tool call of `tool_choice`
    "required" or a named function, or, with tools the model may call and a response format, either."""
    tools = req.tools_in_use()
    forced = tools is not None and (req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
    own = constraint_for(req)
    if not forced:
        if own is None or not tools:
            return own
        if own.kind is not ConstraintKind.JSON_SCHEMA:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"with tools the model may call, {_given(req)[0]} is not "
                               "supported (only a JSON response format): set tool_choice to 'none' or drop it",
                               _given(req)[0])
    elif own is not None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"tool_choice {_choice_name(req)} forces a tool call, so "
                           f"{_given(req)[0]} cannot apply: give one of them", _given(req)[0])
    assert tools is not None
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
    calls = [_call_schema(t["function"]) for t in tools]
    # Several calls only when asked for: with the choice of one more call or eos after each, small models
    # tend to repeat the same call until max_tokens.
    parallel = req.parallel_tool_calls is True and not isinstance(req.tool_choice, NamedToolChoice)
    answer = None if own is None else json.loads(own.text)
    return Constraint(ConstraintKind.LARK, parser.calls_grammar(calls, parallel, answer))


def refuse_constraints(names: Iterable[str], dialect: str) -> None:
    """Raises RequestError(INVALID_ARGUMENT) when any of `names` asks for a constraint `dialect` cannot apply."""
    asked = sorted(CONSTRAINT_FIELDS.intersection(names))
    if asked:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{dialect} takes no constraints ({', '.join(asked)}): use "
                           "/v1/completions, /v1/chat/completions or POST / for structured outputs", asked[0])


def _given(req: GuidedDecoding) -> list[str]:
    fmt = req.response_format
    names = ["response_format"] if fmt is not None and fmt.type != "text" else []
    return names + [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar",
                                      "json_schema") if getattr(req, name) is not None]


def _build(req: GuidedDecoding, param: str) -> Constraint:
    if param == "response_format":
        fmt = req.response_format
        assert fmt is not None
        if fmt.type == "json_object":
            return Constraint.json_schema(fmt.schema_ if fmt.schema_ is not None else {"type": "object"})
        assert fmt.json_schema is not None and fmt.json_schema.schema_ is not None
        schema = fmt.json_schema.schema_
        check_schema_depth(schema)  # before closed() recurses into it
        return Constraint.json_schema(closed(schema) if fmt.json_schema.strict else schema)
    if param == "guided_json":
        value = req.guided_json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"guided_json is not valid JSON: {exc}", param) from None
        if not isinstance(value, (dict, bool)):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "guided_json must be a JSON schema (an object)", param)
        return Constraint.json_schema(value)
    if param == "json_schema":
        assert req.json_schema is not None
        return Constraint.json_schema(req.json_schema)
    if param == "guided_regex":
        assert req.guided_regex is not None
        return Constraint(ConstraintKind.REGEX, req.guided_regex)
    if param == "guided_choice":
        assert req.guided_choice is not None
        return Constraint(ConstraintKind.LARK, "start: " + " | ".join(json.dumps(c) for c in req.guided_choice))
    text = req.guided_grammar if param == "guided_grammar" else req.grammar
    assert text is not None
    return Constraint(ConstraintKind.LARK, _to_lark(text, param))


def _to_lark(text: str, param: str) -> str:
    """A Lark grammar as it is; GBNF (llama.cpp's `root ::= ...`) converted by llguidance's own converter."""
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        return any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain Exceptions for syntax errors
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"invalid {param}: {exc}", param) from None


def _check(constraint: Constraint, param: str) -> None:
    try:
        constraint.check()
    except RequestError as exc:
        raise RequestError(exc.code, f"{param}: {exc.message}", param) from None


def closed(schema: Any) -> Any:
    """The schema with every object that does not say otherwise closed ("additionalProperties": false), as
    OpenAI's strict mode reads a schema; the caller's own document is left as it was."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed(sub) for sub in value]
        elif key in _SCHEMA_VALUES:
            out[key] = closed(value)
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """One function's call as JSON: its name, then arguments that follow its parameter schema."""
    params = function.get("parameters") or {"type": "object"}
    try:
        check_schema_depth(params)  # before closed() or the call grammar's json.dumps recurse into it
    except RequestError as exc:
        raise RequestError(exc.code, f"tools: {function.get('name')}'s parameters: {exc.message}", "tools") from None
    if function.get("strict"):
        params = closed(params)
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": dict(JSON_STYLE)}


def _choice_name(req: ChatCompletionRequest) -> str:
    if isinstance(req.tool_choice, NamedToolChoice):
        return repr(req.tool_choice.function.get("name"))
    return repr(req.tool_choice)
