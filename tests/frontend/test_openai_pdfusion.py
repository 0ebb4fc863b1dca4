"""The official openai client against a real ROLE_TYPE=PDFUSION cluster on the embedded model."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.conftest import Cluster

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(pdfusion: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pdfusion.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_greedy_answer_names_paris(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=FRANCE, temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.role == "assistant"


def test_stream_joined_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                          temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                 temperature=0, max_tokens=40, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_usage_counts(client: openai.OpenAI, pdfusion: Cluster) -> None:
    messages = [{"role": "user", "content": "Count from one to one hundred in words."}]
    rendered = httpx.post(f"{pdfusion.base_url}/v1/chat/render", json={"messages": messages}).json()
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                          temperature=0, max_tokens=7)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(rendered["input_ids"])
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                            max_tokens=7, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


def test_concurrent_requests_match_alone(client: openai.OpenAI, pdfusion: Cluster) -> None:
    prompts = ["Name a color.", "What is 2+2?", "Say hello in French.", "Name a planet."]
    alone = [client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
                                            messages=[{"role": "user", "content": p}]).choices[0].message.content
             for p in prompts]

    async def together() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{pdfusion.base_url}/v1", api_key="unused", max_retries=0)
        resps = await asyncio.gather(*[
            aclient.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
                                            messages=[{"role": "user", "content": p}]) for p in prompts])
        await aclient.close()
        return [r.choices[0].message.content for r in resps]

    assert asyncio.run(together()) == alone


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run() -> str:
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Tell me a story."}],
            temperature=0.9, top_p=0.95, seed=7, max_tokens=20).choices[0].message.content
    assert run() == run()


def test_multibyte_text_streams_whole_characters(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Repeat exactly: 你好世界 🤖 café"}]
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                 temperature=0, max_tokens=30, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert all("\ufffd" not in p for p in pieces)


def test_health_and_models(pdfusion: Cluster) -> None:
    assert httpx.get(f"{pdfusion.base_url}/health").status_code == 200
    models = httpx.get(f"{pdfusion.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
