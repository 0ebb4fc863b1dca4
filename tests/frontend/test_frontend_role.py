"""The OpenAI surface of a real ROLE_TYPE=FRONTEND process against a scripted gRPC backend (no weights):
answers, streaming, the debugging routes, and every bad input answered 4xx with one error shape.
Backend failures and cancellation: test_frontend_role_failures.py; the processes: role_stack.py."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jinja2
import openai
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.frontend.role_stack import EOS_ID, HI, MAX_SEQ_LEN, MODEL, SCRIPT_TEXT, Stack, client, http  # noqa: F401
from tests.support.openai_errors import assert_error
from tests.support.sse import sse_data


def render(http: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Any]:
    resp = http.post("/v1/chat/render", json={"messages": messages})
    assert resp.status_code == 200, resp.text
    return resp.json()


# ---- the OpenAI surface -------------------------------------------------------------------------

def test_non_stream_answer_and_usage(client: openai.OpenAI, http: httpx.Client, stack: Stack) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HI)
    choice = resp.choices[0]
    assert choice.message.content == SCRIPT_TEXT
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert resp.model == MODEL
    assert resp.object == "chat.completion"
    n_prompt = len(render(http, HI)["input_ids"])
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.usage.completion_tokens == len(stack.script_ids)
    assert resp.usage.total_tokens == n_prompt + len(stack.script_ids)


def test_model_may_be_omitted(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": HI})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == SCRIPT_TEXT


def test_stream_with_openai_client(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SCRIPT_TEXT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len({c.id for c in chunks}) == 1


def test_stream_raw_sse(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = sse_data(resp.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == SCRIPT_TEXT
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1


def test_stream_include_usage(client: openai.OpenAI, http: httpx.Client, stack: Stack) -> None:
    n_prompt = len(render(http, HI)["input_ids"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert chunks[-1].usage.completion_tokens == len(stack.script_ids)
    assert chunks[-1].usage.total_tokens == n_prompt + len(stack.script_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # On the wire: `"usage": null` on every other chunk, then the usage chunk, then [DONE].
    resp = http.post("/v1/chat/completions", json={"messages": HI, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    data = sse_data(resp.text)
    assert data[-1] == "[DONE]"
    raw = [json.loads(d) for d in data[:-1]]
    assert all("usage" in c and c["usage"] is None for c in raw[:-1])
    assert raw[-1]["choices"] == [] and raw[-1]["usage"]["completion_tokens"] == len(stack.script_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(client: openai.OpenAI, stream: bool) -> None:
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stop=["there"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        resp = client.chat.completions.create(model=MODEL, messages=HI, stop=["there"])
        text, finishes = resp.choices[0].message.content, [resp.choices[0].finish_reason]
    assert text == "Hello "
    assert finishes == ["stop"]


def test_stop_as_a_single_string(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": HI, "stop": ", fr"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Hello there"


def test_request_the_backend_received(client: openai.OpenAI, http: httpx.Client, stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}]
    input_ids = render(http, messages)["input_ids"]
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    req = stack.servicer.requests[-1]
    assert list(req.token_ids) == input_ids
    assert req.generate_config.max_new_tokens == MAX_SEQ_LEN - len(input_ids)
    assert req.generate_config.temperature == 0.0
    assert req.request_id.startswith("chatcmpl-")

    client.chat.completions.create(model=MODEL, messages=messages, temperature=0.5, max_tokens=5, seed=7)
    cfg = stack.servicer.requests[-1].generate_config
    assert cfg.max_new_tokens == 5
    assert cfg.temperature == pytest.approx(0.5)
    assert cfg.seed == 7


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["max_model_len"] == MAX_SEQ_LEN


def test_health(http: httpx.Client) -> None:
    resp = http.get("/health")
    assert resp.status_code == 200
    assert resp.text == "ok"


def test_tokenizer_encode(http: httpx.Client, tokenizer: TextTokenizer) -> None:
    prompt = SCRIPT_TEXT + "<|im_end|>"
    resp = http.post("/tokenizer/encode", json={"prompt": prompt, "return_offsets_mapping": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["token_ids"] == tokenizer.encode(prompt, parse_special=True)
    assert body["token_ids"][-1] == EOS_ID
    assert body["tokens"] == [tokenizer.id_to_piece(i) for i in body["token_ids"]]
    offsets = body["offset_mapping"]
    assert len(offsets) == len(body["token_ids"])
    assert "".join(prompt[s:e] for s, e in offsets) == prompt
    assert offsets[0] == [0, len("Hello")]
    plain = http.post("/tokenizer/encode", json={"prompt": prompt, "parse_special": False}).json()
    assert EOS_ID not in plain["token_ids"]
    assert "offset_mapping" not in plain


def test_tokenize_prompt_and_messages(http: httpx.Client, tokenizer: TextTokenizer) -> None:
    body = http.post("/tokenize", json={"prompt": SCRIPT_TEXT}).json()
    assert body["token_ids"] == tokenizer.encode(SCRIPT_TEXT)
    body = http.post("/tokenize", json={"messages": HI}).json()
    rendered = render(http, HI)
    assert body["token_ids"] == rendered["input_ids"]
    assert body["prompt"] == rendered["input_prompt"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "Hi", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenizer/encode", {"prompt": "Hi", "return_offset_mapping": True}, "return_offset_mapping"),
])
def test_tokenize_refuses_fields_it_does_not_take(http: httpx.Client, path: str, body: dict[str, object],
                                                  param: str) -> None:
    """They were answered as if absent (a misspelt return_offsets_mapping gave no offsets, silently)."""
    resp = http.post(path, json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = http.post("/tokenize", json={"prompt": "Hi", "model": "gpt-9"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text


def test_render_equals_template(http: httpx.Client, tokenizer: TextTokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U 日本"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": [{"type": "text", "text": "V"}]}]
    body = render(http, messages)
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "V"} for m in messages]
    expected = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        tokenizer.chat_template or "").render(messages=flat, add_generation_prompt=True)
    assert body["input_prompt"] == expected
    assert body["input_ids"] == tokenizer.encode(expected, parse_special=True)
    assert body["max_seq_len"] == MAX_SEQ_LEN
    assert body["eos_token_id"] == EOS_ID
    assert body["renderer_info"]["template_source"] == "model"


def test_render_user_template_ssti_is_400(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/render", json={"messages": HI,
                                              "user_template": "{{ cycler.__init__.__globals__ }}"})
    assert_error(resp, 400, "invalid_argument")
    resp = http.post("/v1/chat/completions", json={"messages": HI, "user_template": "{{ messages.__class__ }}"})
    assert_error(resp, 400, "invalid_argument")


def test_a_slow_template_holds_neither_the_frontend_nor_other_requests(http: httpx.Client) -> None:
    """Nested loops in a user_template used to block the event loop (/health included) for 30 s+:
    the render runs on a worker thread within a time budget, then ends in a 400."""
    slow = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        pending = pool.submit(http.post, "/v1/chat/render", json={"messages": HI, "user_template": slow})
        time.sleep(0.3)  # the render is under way
        health = [http.get("/health", timeout=2) for _ in range(5)]
        rendered = http.post("/v1/chat/render", json={"messages": HI}, timeout=2)
        during = time.monotonic() - started
        resp = pending.result(timeout=30)
    assert all(h.status_code == 200 for h in health) and rendered.status_code == 200
    assert during < 2.0  # all of that happened while the slow render still ran (its budget: 2 s)
    assert_error(resp, 400, "invalid_argument")
    assert "budget" in resp.json()["error"]["message"]


# ---- bad input: always 4xx with one error shape, never 422 or 500 -------------------------------

LONG = [{"role": "user", "content": "word " * 200}]

BAD_INPUTS: list[tuple[str, str, Any, int, str | None]] = [
    # id, path, body (bytes = raw), status, code
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not-json", "/v1/chat/completions", b"hello", 400, None),
    ("json-array", "/v1/chat/completions", [1, 2], 400, None),
    ("no-messages", "/v1/chat/completions", {"model": MODEL}, 400, None),
    ("messages-string", "/v1/chat/completions", {"messages": "hi"}, 400, None),
    ("temperature-hot", "/v1/chat/completions", {"messages": HI, "temperature": "hot"}, 400, None),
    ("temperature-big", "/v1/chat/completions", {"messages": HI, "temperature": 9}, 400, None),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, None),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("max-tokens-0", "/v1/chat/completions", {"messages": HI, "max_tokens": 0}, 400, "invalid_argument"),
    ("max-tokens-neg", "/v1/chat/completions", {"messages": HI, "max_tokens": -1}, 400, "invalid_argument"),
    ("max-completion-0", "/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, 400,
     "invalid_argument"),
    ("max-tokens-str", "/v1/chat/completions", {"messages": HI, "max_tokens": "many"}, 400, None),
    ("empty-stop", "/v1/chat/completions", {"messages": HI, "stop": [""]}, 400, None),
    ("n-0", "/v1/chat/completions", {"messages": HI, "n": 0}, 400, None),
    ("logit-bias-key", "/v1/chat/completions", {"messages": HI, "logit_bias": {"x": 1}}, 400, "invalid_argument"),
    ("logit-bias-id", "/v1/chat/completions", {"messages": HI, "logit_bias": {"99999999": 1}}, 400,
     "invalid_argument"),
    ("template-key-and-user-template", "/v1/chat/completions",
     {"messages": HI, "template_key": "default", "user_template": "{{ messages }}"}, 400, "invalid_argument"),
    ("bad-user-template", "/v1/chat/completions", {"messages": HI, "user_template": "{% for %}"}, 400,
     "invalid_argument"),
    ("prompt-too-long", "/v1/chat/completions", {"messages": LONG}, 400, "context_length_exceeded"),
    ("prompt-too-long-stream", "/v1/chat/completions", {"messages": LONG, "stream": True}, 400,
     "context_length_exceeded"),
    ("unknown-model", "/v1/chat/completions", {"model": "gpt-9", "messages": HI}, 404, "model_not_found"),
    ("unknown-model-stream", "/v1/chat/completions", {"model": "gpt-9", "messages": HI, "stream": True}, 404,
     "model_not_found"),
    ("render-empty", "/v1/chat/render", {"messages": []}, 400, None),
    ("render-malformed", "/v1/chat/render", b"{", 400, None),
    ("encode-no-prompt", "/tokenizer/encode", {"text": "x"}, 400, "invalid_argument"),
    ("encode-malformed", "/tokenizer/encode", b"[", 400, None),
    ("tokenize-no-prompt", "/tokenize", {"prompt": 3}, 400, "invalid_argument"),
    ("tokenize-bad-messages", "/tokenize", {"messages": "hi"}, 400, None),
    ("unknown-route", "/v1/nope", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(http: httpx.Client, path: str, body: Any, status: int, code: str | None) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code not in (422, 500), resp.text
    assert_error(resp, status, code)


def test_bad_input_without_content_type(http: httpx.Client) -> None:
    # curl -d sends a form content type; the body is still read (and refused) as JSON.
    resp = http.post("/v1/chat/completions", content=b'{"messages": "hi"}',
                     headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(resp, 400)


def test_wrong_method(http: httpx.Client) -> None:
    resp = http.get("/v1/chat/completions")
    assert resp.status_code == 405
    assert_error(resp, 405)


def test_max_tokens_beyond_context_names_the_numbers(http: httpx.Client) -> None:
    n_prompt = len(render(http, HI)["input_ids"])
    resp = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1000})
    err = assert_error(resp, 400, "context_length_exceeded")
    for number in (MAX_SEQ_LEN, n_prompt, 1000, n_prompt + 1000):
        assert str(number) in err["message"]
    assert err["param"] == "max_tokens"
    # Exactly filling the context is fine.
    ok = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": MAX_SEQ_LEN - n_prompt})
    assert ok.status_code == 200, ok.text
    over = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": MAX_SEQ_LEN - n_prompt + 1})
    assert_error(over, 400, "context_length_exceeded")


def test_prompt_beyond_context_names_the_numbers(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": LONG})
    err = assert_error(resp, 400, "context_length_exceeded")
    assert str(MAX_SEQ_LEN) in err["message"]
    assert err["param"] == "messages"


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1000)
    assert bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HI)
