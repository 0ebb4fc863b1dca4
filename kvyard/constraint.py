"""A constraint on generated text (structured outputs, forced tool calls) as it travels frontend → backend:
the grammar's kind and text. The frontend builds and checks it (frontend/guided.py), the backend compiles it
into a per-sequence token mask (backend/constraints.py); both read it through `llguidance_grammar` here, so
what was checked is what runs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvyard.errors import ErrorCode, RequestError
from kvyard.grammar_depth import lark_depth, schema_depth
from kvyard.limits import MAX_GRAMMAR_DEPTH, MAX_SCHEMA_DEPTH

# JSON as models write it: one space after ':' and ',', no newlines. Bounded whitespace also keeps a small
# model from wandering into endless blank lines inside an object (a known failure of flexible whitespace).
# A schema's own "x-guidance" object overrides any of these (llguidance reads defaults, then x-guidance).
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

MAX_CONSTRAINT_CHARS = 1_000_000  # a schema or grammar past this is refused before anything compiles it


class ConstraintKind(Enum):
    JSON_SCHEMA = "json_schema"  # a JSON Schema document (JSON text): the output is one value matching it
    REGEX = "regex"              # a regular expression (Rust regex syntax) the whole output matches
    LARK = "lark"                # a Lark grammar in llguidance's dialect (`%json {...}` embeds a schema)


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Constraint:
        # ASCII: a lone surrogate in a client's schema becomes a \\ud800 escape llguidance refuses (a 400),
        # not text that cannot be encoded on the way to the backend.
        check_schema_depth(schema)
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    def llguidance_grammar(self) -> str:
        """The grammar as llguidance's LLMatcher takes it. Raises RequestError for text that is not even
        the right shape (a schema that is not a JSON object); grammar errors are `check`'s."""
        from llguidance import LLMatcher
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the {self.kind.value} is {len(self.text)} characters; "
                               f"at most {MAX_CONSTRAINT_CHARS} are accepted")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the JSON schema is not valid JSON: {exc}") from None
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "a JSON schema must be a JSON object")
            check_schema_depth(schema)
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_STYLE))
            except ValueError as exc:  # e.g. an integer beyond 64 bits, which llguidance cannot take
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"the JSON schema cannot be used: {exc} (numbers must fit in 64 bits)") from None
        if self.kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(self.text)
        rules, embedded = lark_depth(self.text, MAX_SCHEMA_DEPTH, MAX_GRAMMAR_DEPTH)
        if rules > MAX_GRAMMAR_DEPTH:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the grammar nests rules more than {MAX_GRAMMAR_DEPTH} "
                               f"deep (a rule using a rule using ...); at most {MAX_GRAMMAR_DEPTH} are accepted")
        _check_schema_depth_value(embedded)
        return LLMatcher.grammar_from_lark(self.text)

    def check(self) -> None:
        """Raises RequestError(INVALID_ARGUMENT) naming the problem: an invalid schema, a keyword llguidance
        does not implement, a grammar or regex syntax error. Needs no tokenizer (the frontend has none loaded
        for this), so it is cheap enough to run before every request."""
        from llguidance import LLMatcher
        error = LLMatcher.validate_grammar(self.llguidance_grammar())
        if error:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"invalid {self.kind.value}: {error.strip()}")


def check_schema_depth(schema: Any) -> None:
    """Raises RequestError(INVALID_ARGUMENT) for a schema nested past MAX_SCHEMA_DEPTH; call it before
    anything recurses into the schema (json.dumps, llguidance: kvyard/grammar_depth.py)."""
    _check_schema_depth_value(schema_depth(schema, MAX_SCHEMA_DEPTH))


def _check_schema_depth_value(depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels "
                           f"deep (counting each $ref into its target); at most {MAX_SCHEMA_DEPTH} are accepted")
