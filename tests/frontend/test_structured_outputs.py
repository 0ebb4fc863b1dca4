"""Structured outputs and forced tool calls end to end: the official openai client against a real PDFUSION
cluster on the embedded model (greedy and sampled, streaming and not). Requests run concurrently, so the
engine batches them and the module stays quick."""
from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import Cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
T = TypeVar("T")
TOPICS = ["a pirate", "a teacher", "a baker", "a robot", "an astronaut", "a child", "a king", "a nurse", "a farmer",
          "a musician", "a dragon", "a detective", "a painter", "a chef", "a soldier", "a student", "a grandmother",
          "a wizard", "a sailor", "a doctor"]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]


class Weather(BaseModel):
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


class Time(BaseModel):
    timezone: str = Field(max_length=30)


@pytest.fixture(scope="module")
def client(pdfusion: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pdfusion.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def concurrently(fn: Callable[..., T], cases: list[tuple[Any, ...]]) -> list[T]:
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        return list(pool.map(lambda case: fn(*case), cases))


def test_parse_gives_a_valid_object_on_every_prompt(client: openai.OpenAI) -> None:
    def ask(topic: str, temperature: float, stream: bool, seed: int) -> Person | None:
        kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": f"Describe {topic} as a person."}],
                                  response_format=Person, temperature=temperature, max_tokens=40, seed=seed)
        if not stream:
            choice = client.chat.completions.parse(**kw).choices[0]
        else:
            with client.chat.completions.stream(**kw) as events:
                for _ in events:
                    pass
                choice = events.get_final_completion().choices[0]
        assert choice.finish_reason == "stop"
        return choice.message.parsed

    # Every prompt greedy and sampled; half of them streamed, half not (each way, both temperatures).
    cases = [(topic, temperature, i % 2 == 1, i) for temperature in (0.0, 1.0) for i, topic in enumerate(TOPICS)]
    parsed = concurrently(ask, cases)
    assert all(isinstance(p, Person) for p in parsed), [c for c, p in zip(cases, parsed) if p is None]
    assert len({p.name for p in parsed[:20]}) > 5  # twenty prompts, not one canned answer


_FILLERS = ["", '"', '":0', ':0', '0', '"":0', 'ull', 'll', 'l', 'rue', 'ue', 'e', 'alse', 'lse', 'se']


def is_json_object_prefix(text: str) -> bool:
    """Whether text is the start of a JSON object: some filler for a cut key, value or literal, then the open
    strings and brackets closed, makes it parse (checked without the server's grammar)."""
    for filler in _FILLERS:
        done, stack, in_string, escaped = text + filler, [], False, False
        for ch in done:
            if in_string:
                escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                stack.append("}" if ch == "{" else "]")
            elif ch in "}]" and stack:
                stack.pop()
        try:
            if isinstance(json.loads(done + ('"' if in_string else "") + "".join(reversed(stack))), dict):
                return True
        except ValueError:
            continue
    return False


def test_json_object_prefix_checker() -> None:
    for text in ['{"a": "x', '{"a"', '{"a": tr', '{"a": [1, 2', '{"a": {"b": 1.5,', '{', '{"a": "\\"q']:
        assert is_json_object_prefix(text), text
    for text in ['Sure! {"a": 1}', '["a"', '{"a" 1', '{"a": 1}}', '{a: 1']:
        assert not is_json_object_prefix(text), text


def test_json_object_always_parses(client: openai.OpenAI) -> None:
    """Every answer that ends is a JSON object, and every greedy one ends within its budget; a sampled answer may
    run out of tokens (a 135M model at temperature 1 can spell one key for 120 tokens: which seed does depends
    on the kernels' last bits), and then it is still a JSON object cut short, never free text."""
    def ask(topic: str, temperature: float) -> tuple[str, str]:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give the name and colour of {topic} as JSON."}],
            response_format={"type": "json_object"}, temperature=temperature, max_tokens=120, seed=7)
        return resp.choices[0].finish_reason, resp.choices[0].message.content or ""
    cases = [(t, temp) for t in ("an apple", "the sky", "a banana") for temp in (0.0, 1.0)]
    for (_, temp), (finish, text) in zip(cases, concurrently(ask, cases)):
        assert finish in ("stop", "length") and (finish == "stop" or temp > 0), (finish, text)
        assert isinstance(json.loads(text), dict) if finish == "stop" else is_json_object_prefix(text), text


def test_required_and_named_tool_choice_force_valid_calls(client: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(Weather, name="get_weather"),
             openai.pydantic_function_tool(Time, name="get_time")]

    def ask(city: str, choice: Any, temperature: float, stream: bool) -> Any:
        kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": f"What is it like in {city}?"}],
                                  tools=tools, tool_choice=choice, temperature=temperature, max_tokens=48, seed=3)
        if not stream:
            return client.chat.completions.parse(**kw).choices[0]
        with client.chat.completions.stream(**kw) as events:
            deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
            choice_ = events.get_final_completion().choices[0]
        assert len(deltas) > 1  # the arguments arrived in pieces as they were written
        return choice_

    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [(city, choice, temp, stream) for city in ("Paris", "Tokyo") for choice in ("required", named)
             for temp, stream in ((0.0, False), (0.0, True), (1.0, True))]
    for (city, choice, _, _), result in zip(cases, concurrently(ask, cases)):
        assert result.finish_reason == "tool_calls", result.message
        (call,) = result.message.tool_calls
        assert isinstance(call.function.parsed_arguments, Weather | Time)  # validated against its schema
        if choice != "required":
            assert call.function.name == "get_time" and isinstance(call.function.parsed_arguments, Time)


def test_completions_and_raw_take_constraints(pdfusion: Cluster) -> None:
    done = httpx.post(f"{pdfusion.base_url}/v1/completions", timeout=60, json={
        "prompt": "The year the first man walked on the moon:", "max_tokens": 8, "temperature": 0,
        "guided_regex": "[12][0-9]{3}"}).json()
    assert len(done["choices"][0]["text"]) == 4 and done["choices"][0]["text"].isdigit()
    raw = httpx.post(f"{pdfusion.base_url}/", timeout=60, json={
        "prompt": "My favourite colour is", "grammar": 'root ::= " red" | " green" | " blue"',
        "generate_config": {"max_new_tokens": 8, "temperature": 1.0}}).json()
    assert raw["response"] in (" red", " green", " blue") and raw["finished"]


def test_a_bad_schema_is_a_400_the_client_raises(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "tags", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], response_format=bad)
    assert refused.value.status_code == 400 and refused.value.param == "response_format"
    assert "uniqueItems" in refused.value.message
