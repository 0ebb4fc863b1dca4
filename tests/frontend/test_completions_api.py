"""/v1/completions (prompt forms, echo, logprobs, streaming) and RTP-LLM's raw `POST /`, with the official
client and httpx against an in-process frontend and the product mock backend."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from backend.mock_backend import mock_logprob
from frontend.pipeline import Pipeline
from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, script
from tests.support.sse import sse_data

TEXT = "Hello there, friend!"
MODEL = "mock-model"


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, TEXT)) as backend:
        yield backend


# ---- /v1/completions -----------------------------------------------------------------------------

def test_completions_prompt_forms(client: openai.OpenAI, tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=50)
    assert resp.object == "text_completion" and resp.choices[0].text == TEXT
    assert list(mock.servicer.requests[-1].token_ids) == tokenizer.encode("Once upon")
    assert resp.usage.prompt_tokens == len(tokenizer.encode("Once upon"))
    assert resp.choices[0].finish_reason == "stop"
    ids = tokenizer.encode("a b c")
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert list(mock.servicer.requests[-1].token_ids) == ids
    assert resp.choices[0].finish_reason == "length"
    resp = client.completions.create(model=MODEL, prompt=["one", "two", "three"], n=2, max_tokens=50)
    assert [c.index for c in sorted(resp.choices, key=lambda c: c.index)] == list(range(6))
    assert all(c.text == TEXT for c in resp.choices)
    resp = client.completions.create(model=MODEL, prompt=[ids, tokenizer.encode("x")], max_tokens=2)
    assert len(resp.choices) == 2
    resp = client.completions.create(model=MODEL, prompt="x", extra_body={"extra_configs": {
        "num_return_sequences": 3}})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]


def test_completions_echo_and_logprobs(client: openai.OpenAI, tokenizer: TextTokenizer,
                                       mock: MockBackendThread) -> None:
    prompt = "The sky is"
    p_ids = tokenizer.encode(prompt)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    choice = resp.choices[0]
    gen = list(mock.servicer.script.token_ids[:3])
    assert choice.text == prompt + tokenizer.decode(gen)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in p_ids + gen]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([mock_logprob(t) for t in p_ids[1:] + gen])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[len(p_ids)] == len(prompt)
    # Scoring only: echo with max_tokens 0 generates nothing.
    n_before = len(mock.servicer.requests)
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and len(mock.servicer.requests) == n_before
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx([mock_logprob(t) for t in p_ids[1:]])


def test_completions_stream(client: openai.OpenAI, tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=50, stream=True,
                                            echo=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(mock.servicer.script.token_ids)
    for index, prompt in enumerate(["a", "b"]):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == prompt + TEXT
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]
    with mock.scripted(script(tokenizer, TEXT, per_char=True)):
        chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=50, stream=True, stop=[" there"]))
    assert "".join(c.choices[0].text for c in chunks) == "Hello"


# ---- RTP-LLM's raw POST / ------------------------------------------------------------------------

def test_raw_generate(http: httpx.Client, tokenizer: TextTokenizer, mock: MockBackendThread) -> None:
    out = http.post("/", json={"prompt": "Hi", "generate_config": {"max_new_tokens": 50, "return_output_ids": True}})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["response"] == TEXT and body["finished"] is True
    assert body["aux_info"]["output_len"] == len(mock.servicer.script.token_ids)
    assert body["output_ids"] == [list(mock.servicer.script.token_ids)]
    multi = http.post("/", json={"prompt": "Hi", "generate_config": {"num_return_sequences": 2}}).json()
    assert multi["response"] == [TEXT, TEXT] and len(multi["aux_info"]) == 2
    batch = http.post("/", json={"prompt": ["a", "b"], "max_new_tokens": 2}).json()   # top-level config keys
    two = tokenizer.decode(list(mock.servicer.script.token_ids[:2]))
    assert [r["response"] for r in batch["response_batch"]] == [two, two]
    assert mock.servicer.requests[-1].generate_config.max_new_tokens == 2


@pytest.mark.parametrize("incremental", [False, True])
def test_raw_generate_stream(http: httpx.Client, incremental: bool) -> None:
    resp = http.post("/", json={"prompt": "Hi", "generate_config": {"is_streaming": True}, "incremental": incremental})
    data = sse_data(resp.text)
    assert data[-1] == "[done]"
    events = [json.loads(d) for d in data[:-1]]
    texts = [e["response"] for e in events]
    if incremental:
        assert "".join(texts) == TEXT
    else:
        assert texts[-1] == TEXT and all(TEXT.startswith(t) for t in texts)
    assert [e["finished"] for e in events].count(True) == 1 and events[-1]["finished"]


# ---- tokenizing holds nobody else ----------------------------------------------------------------

@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
    ("/", {"prompt": "a", "generate_config": {"max_new_tokens": 2}}),
])
def test_tokenizing_runs_off_the_event_loop(http: httpx.Client, monkeypatch: pytest.MonkeyPatch, path: str,
                                            body: dict[str, object]) -> None:
    """A big prompt used to be tokenized on the event loop, blocking /health and every stream meanwhile:
    with tokenizing made slow (0.5 s a prompt), /health still answers at once while it runs."""
    tokenize = Pipeline.tokens
    started = threading.Event()

    def slow_tokens(*args: object) -> object:
        started.set()
        time.sleep(0.5)
        return tokenize(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(Pipeline, "tokens", slow_tokens)
    result: list[httpx.Response] = []
    request = threading.Thread(target=lambda: result.append(http.post(path, json=body)))
    request.start()
    assert started.wait(5)
    begun = time.monotonic()
    health = [http.get("/health", timeout=2).status_code for _ in range(3)]
    waited = time.monotonic() - begun
    request.join(10)
    assert health == [200] * 3 and waited < 0.4, waited
    assert result and result[0].status_code == 200, result
