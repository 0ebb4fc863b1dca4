"""Constraints at the frontend (frontend/guided.py) against the mock backend: every way to ask for one reaches the
backend as GenerateConfigPB.constraint on chat, /v1/completions and POST /; a forced tool call carries the
parser's grammar; bad schemas, unsupported keywords, grammar syntax errors and conflicting fields are a 400
with the OpenAI error object before anything is generated; /generate and LMTP, which take no constraints,
refuse them."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from llguidance import LLMatcher

from frontend.guided import closed
from frontend.lmtp_frames import FrameError, parse_frame
from kvyard.constraint import Constraint
from kvyard.tokenizer import TextTokenizer
from proto import model_rpc_pb2 as pb
from tests.support.mock_stack import MockBackendThread, MockFrontend, script

HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, '{"a": 1}')) as backend:
        yield backend


def sent(mock: MockBackendThread) -> pb.ConstraintPB | None:
    cfg = mock.servicer.requests[-1].generate_config
    return cfg.constraint if cfg.HasField("constraint") else None


ASKED = [  # (extra body fields, the kind the backend gets, a piece of its text)
    ({"response_format": {"type": "json_object"}}, pb.CONSTRAINT_KIND_JSON_SCHEMA, '{"type":"object"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     pb.CONSTRAINT_KIND_JSON_SCHEMA, '"required":["a"]}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     pb.CONSTRAINT_KIND_JSON_SCHEMA, '"additionalProperties":false'),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, pb.CONSTRAINT_KIND_JSON_SCHEMA, '"a"'),
    ({"guided_json": SCHEMA}, pb.CONSTRAINT_KIND_JSON_SCHEMA, '"a"'),
    ({"guided_json": json.dumps(SCHEMA)}, pb.CONSTRAINT_KIND_JSON_SCHEMA, '"a"'),
    ({"json_schema": SCHEMA}, pb.CONSTRAINT_KIND_JSON_SCHEMA, '"a"'),
    ({"guided_regex": "[0-9]+"}, pb.CONSTRAINT_KIND_REGEX, "[0-9]+"),
    ({"guided_choice": ["yes", "no"]}, pb.CONSTRAINT_KIND_LARK, 'start: "yes" | "no"'),
    ({"guided_grammar": 'start: "a"+'}, pb.CONSTRAINT_KIND_LARK, '"a"+'),
    ({"grammar": 'root ::= "yes" | "no"'}, pb.CONSTRAINT_KIND_LARK, '"yes"'),  # GBNF, converted
    ({"response_format": {"type": "text"}}, None, None),
]


@pytest.mark.parametrize(("fields", "kind", "piece"), ASKED)
def test_every_source_reaches_the_backend(http: httpx.Client, mock: MockBackendThread, fields: dict[str, Any],
                                          kind: int | None, piece: str | None) -> None:
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/", {"prompt": "Hi"})):
        assert http.post(path, json={**body, **fields}).status_code == 200, path
        got = sent(mock)
        if kind is None:
            assert got is None
            continue
        assert got is not None and got.kind == kind and piece in got.text, (path, got)


def test_forced_tool_calls_carry_the_call_grammar(http: httpx.Client, mock: MockBackendThread) -> None:
    http.post("/v1/chat/completions", json={"messages": HI, "tools": [TOOL, OTHER], "tool_choice": "required"})
    required = sent(mock)
    assert required is not None and required.kind == pb.CONSTRAINT_KIND_LARK
    assert '"<tool_call>\\n"' in required.text and "get_weather" in required.text and '"now"' in required.text
    assert "calls: call\n" in required.text + "\n"  # one call unless parallel_tool_calls is true
    http.post("/v1/chat/completions", json={"messages": HI, "tools": [TOOL, OTHER], "tool_choice": "required",
                                            "parallel_tool_calls": True})
    assert 'calls: call ("\\n" call)*' in sent(mock).text  # type: ignore[union-attr]
    http.post("/v1/chat/completions", json={"messages": HI, "tools": [TOOL, OTHER],
                                            "tool_choice": {"type": "function", "function": {"name": "now"}}})
    named = sent(mock)
    assert named is not None and '"now"' in named.text and "get_weather" not in named.text
    http.post("/v1/chat/completions", json={"messages": HI, "tools": [TOOL], "response_format": {"type": "json_object"}})
    either = sent(mock)
    assert either is not None and either.text.startswith("start: answer | calls")
    http.post("/v1/chat/completions", json={"messages": HI, "tools": [TOOL]})  # auto: free text, no constraint
    assert sent(mock) is None


def ref_chain(n: int) -> dict[str, Any]:
    """n objects, each with one property that $refs the next (llguidance's stack ran out near 900)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def rule_chain(n: int) -> str:
    """n Lark rules, each using the next (84 KB at 3,000: it killed the frontend)."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "x"'])


DEEP = [  # refused by their depth before llguidance recurses into them (kvyard/limits.py)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": ref_chain(1000)}}}, "response_format", "more than 200 levels"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": ref_chain(1000), "strict": True}}}, "response_format", "more than 200 levels"),
    ("/v1/chat/completions", {"guided_json": ref_chain(1000)}, "guided_json", "more than 200 levels"),
    ("/v1/completions", {"guided_json": json.dumps(ref_chain(1000))}, "guided_json", "more than 200 levels"),
    ("/", {"json_schema": ref_chain(1000)}, "json_schema", "more than 200 levels"),
    ("/v1/chat/completions", {"guided_grammar": rule_chain(3000)}, "guided_grammar", "more than 400 deep"),
    ("/v1/chat/completions", {"guided_grammar": f"start: %json {json.dumps(ref_chain(1000))}"}, "guided_grammar",
     "more than 200 levels"),
    ("/v1/chat/completions", {"tools": [{**TOOL, "function": {**TOOL["function"], "parameters": ref_chain(250)}}],
                              "tool_choice": "required"}, "tools", "more than 200 levels"),  # 1000: past the context
]

BAD = DEEP + [  # (path, fields, the param named, a piece of the message)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format", "Invalid type: strin"),
    ("/v1/chat/completions", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ("/v1/chat/completions", {"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ("/v1/chat/completions", {"guided_json": [1, 2]}, "guided_json", "valid dictionary"),
    ("/v1/chat/completions", {"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
    ("/v1/chat/completions", {"guided_grammar": "start: missing"}, "guided_grammar", "missing"),
    ("/v1/completions", {"grammar": 'root ::= nowhere'}, "grammar", "nowhere"),
    ("/", {"json_schema": {"$ref": "#/nope"}}, "json_schema", "/nope"),
    ("/v1/chat/completions", {"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "alternatives"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "forces a tool call"),
    ("/v1/chat/completions", {"tools": [{**TOOL, "function": {**TOOL["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "strin"}}}}}], "tool_choice": "required"}, "tools", "strin"),
    ("/v1/chat/completions", {"tools": [TOOL], "guided_regex": "a+"}, "guided_regex", "only a JSON response format"),
    # an integer past 64 bits (found by the fuzzer: llguidance cannot take it, and it was a 500)
    ("/v1/chat/completions", {"guided_json": {"const": -223553508730973517971980288}}, "guided_json", "64 bits"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "maximum": 10**30}}}}, "response_format", "64 bits"),
]


@pytest.mark.parametrize(("path", "fields", "param", "piece"), BAD)
def test_bad_constraints_are_a_400_before_generation(http: httpx.Client, mock: MockBackendThread, path: str,
                                                     fields: dict[str, Any], param: str, piece: str) -> None:
    before = len(mock.servicer.requests)
    body = {"messages": HI} if "chat" in path else {"prompt": "Hi"}
    for stream in (False, True):
        resp = http.post(path, json={**body, **fields, "stream": stream})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert piece in error["message"] and (error["param"] or "").startswith(param), error
    assert len(mock.servicer.requests) == before  # nothing reached the backend


def test_deep_grammars_leave_the_server_up_and_recursive_ones_pass(http: httpx.Client,
                                                                   mock: MockBackendThread) -> None:
    """After the deep ones above: still serving. A recursive schema (a tree) and chains within the limits
    are no deeper than they look: they reach the backend."""
    tree = {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    for fields in ({"guided_json": tree}, {"guided_json": ref_chain(40)}, {"guided_grammar": rule_chain(300)}):
        resp = http.post("/v1/chat/completions", json={"messages": HI, **fields})
        assert resp.status_code == 200, resp.text
    assert http.get("/health").status_code == 200


def test_strict_closes_objects_the_schema_leaves_open() -> None:
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "number"}}},
                                               "properties": {"type": "string"}, "free": {"type": "object",
                                                                                          "additionalProperties": True}},
              "$defs": {"d": {"properties": {"y": {"const": {"type": "object"}}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["free"]["additionalProperties"] is True      # it said otherwise
    assert "additionalProperties" not in out["properties"]["properties"]  # a property called "properties"
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["$defs"]["d"]["properties"]["y"]["const"] == {"type": "object"}  # data, not a schema
    assert "additionalProperties" not in schema                          # the caller's document untouched
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(out)) == ""


def test_dialects_without_constraints_refuse_them(http: httpx.Client, mock: MockBackendThread) -> None:
    before = len(mock.servicer.requests)
    resp = http.post("/generate?max_tokens=4&guided_regex=[0-9]%2B", content="Hi")
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "guided_regex" and "/generate takes no constraints" in error["message"], error
    with pytest.raises(FrameError, match="LMTP takes no constraints \\(grammar, response_format\\)") as refused:
        parse_frame('GENERATE {"stream_id": 7, "prompt": [1], "grammar": "root ::= \\"a\\"", '
                    '"response_format": {"type": "json_object"}}')
    assert refused.value.stream_id == 7
    assert len(mock.servicer.requests) == before  # nothing reached the backend
    assert http.post("/generate?max_tokens=4", content="Hi").status_code == 200
    assert parse_frame('GENERATE {"stream_id": 8, "prompt": [1], "grammar": null}')[0] == "GENERATE"


# ---- the grammar pool (frontend/off_loop.py) ----------------------------------------------------------

def held_checks(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[Constraint]]:
    """A fake slow compiler: every llguidance check holds its grammar worker until the event is set."""
    release, started = threading.Event(), []
    real = Constraint.check

    def slow(self: Constraint) -> None:
        started.append(self)
        release.wait(60)
        real(self)
    monkeypatch.setattr(Constraint, "check", slow)
    return release, started


def test_a_plain_chat_never_waits_behind_big_grammars(front: MockFrontend, mock: MockBackendThread,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Six grammars hold both grammar workers (four queue behind them); a chat's preparation does not wait:
    it is answered while every grammar is still held. Once released, every grammar request is answered."""
    release, started = held_checks(monkeypatch)
    results: list[int] = []

    def grammar_request() -> None:
        results.append(httpx.post(f"{front.url}/v1/chat/completions", timeout=60,
                                  json={"messages": HI, "guided_json": SCHEMA}).status_code)
    threads = [threading.Thread(target=grammar_request) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(started) < 2:  # both workers hold a grammar
            assert time.monotonic() < deadline, "the grammar checks never started"
            time.sleep(0.02)
        chat = httpx.post(f"{front.url}/v1/chat/completions", json={"messages": HI}, timeout=20)
        assert chat.status_code == 200, chat.text
        assert len(started) == 2 and not results  # the chat went by while the grammars were still held
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert results == [200] * 6


def test_a_grammar_past_its_time_budget_fails_alone(front: MockFrontend, mock: MockBackendThread,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from frontend import off_loop
    monkeypatch.setattr(off_loop, "GRAMMAR_BUDGET_S", 0.3)
    release, started = held_checks(monkeypatch)
    try:
        resp = httpx.post(f"{front.url}/v1/chat/completions", json={"messages": HI, "guided_json": SCHEMA}, timeout=20)
        assert resp.status_code == 400 and "more than 0.3 s" in resp.json()["error"]["message"], resp.text
        assert httpx.post(f"{front.url}/v1/chat/completions", json={"messages": HI}, timeout=20).status_code == 200
    finally:
        release.set()
