"""Frontend behaviour that needs the real engine (ROLE_TYPE=PDFUSION on the embedded model): a client that
goes away frees the request's KV in the backend (its /worker_status on START_PORT+5), streaming or not;
completions' echo scoring agrees with generation; tools with a real model never fail the request."""
from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
import pytest

from kvyard.tokenizer import TextTokenizer
from tests.conftest import Cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LONG = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 2000, "extra_configs": {"ignore_eos": True}}


def worker_status(cluster: Cluster) -> dict[str, Any]:
    port = urlparse(cluster.base_url).port
    return httpx.get(f"http://127.0.0.1:{port + 5}/worker_status", timeout=5).json()


def wait_idle(cluster: Cluster, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        st = worker_status(cluster)
        if st["running"] == 0 and st["waiting"] == 0 and st["free_blocks"] == st["total_blocks"]:
            return st
        assert time.monotonic() < deadline, f"the backend still holds the request: {st}"
        time.sleep(0.1)


def test_stream_disconnect_frees_kv(pdfusion: Cluster) -> None:
    wait_idle(pdfusion)
    seen: list[str] = []
    with httpx.stream("POST", f"{pdfusion.base_url}/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            seen += [line] if line else []
            if len(seen) == 4:
                # Still reading: the request holds KV now. (Leaving this loop closes the connection.)
                busy = worker_status(pdfusion)
                break
    assert all("error" not in line for line in seen), seen
    assert busy["running"] == 1 and busy["free_blocks"] < busy["total_blocks"], busy
    wait_idle(pdfusion)


def test_non_stream_disconnect_frees_kv(pdfusion: Cluster) -> None:
    wait_idle(pdfusion)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{pdfusion.base_url}/v1/chat/completions", json=LONG, timeout=2.0)
    # 2000 tokens take far longer than this on CPU: only a cancelled request is gone this soon.
    wait_idle(pdfusion, timeout_s=5.0)


def test_echo_scoring_matches_generation(pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    client = openai.OpenAI(base_url=f"{pdfusion.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = tokenizer.encode("The capital of France is")
    raw = httpx.post(f"{pdfusion.base_url}/", json={"prompt": tokenizer.decode(prompt), "generate_config": {
        "max_new_tokens": 5, "temperature": 0, "return_output_ids": True}}, timeout=60).json()
    out_ids = raw["output_ids"][0]
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=0)
    assert gen.choices[0].text == raw["response"]
    scored = client.completions.create(model=MODEL, prompt=prompt + out_ids, max_tokens=0, echo=True, logprobs=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == tokenizer.decode(prompt + out_ids)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 5
    assert lp.token_logprobs[-5:] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=0.02)


def test_tools_with_the_real_model(pdfusion: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{pdfusion.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], temperature=0,
                                          max_tokens=60)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[tool], temperature=0,
                                                 max_tokens=60, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
