"""BACKEND_PROTOCOL=rtp_llm (frontend/rtp_backend_client.py): kvyard's frontend streams from a backend that
speaks only RTP-LLM's RpcService.GenerateStreamCall (the seed's mock backend script, tests/support/
rtp_mock_backend.py) and from kvyard's own backend over that protocol, through the official openai client;
a sampling field RTP-LLM's message cannot carry is a 400 naming it."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from frontend.rtp_backend_client import config_to_rtp
from kvyard.sampling_params import SamplingParams
from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import EOS, MockBackendThread, MockFrontend, mock_frontend, script
from tests.support.procs import free_port_block
from tests.support.rtp_mock_backend import MockRpcServer, int32_tensor, start

ANSWER = "Hello from RTP-LLM"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def rtp_mock(tokenizer: TextTokenizer) -> Iterator[tuple[str, MockRpcServer]]:
    port = free_port_block(1)
    server, servicer = start(port, [*tokenizer.encode(ANSWER), EOS])
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def front(tokenizer: TextTokenizer, rtp_mock: tuple[str, MockRpcServer]) -> Iterator[MockFrontend]:
    with mock_frontend(tokenizer, rtp_mock[0], BACKEND_PROTOCOL="rtp_llm") as front:
        yield front


def client(front: MockFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0, timeout=10)


def test_the_seed_mock_answers_a_chat_completion(front: MockFrontend, rtp_mock: tuple[str, MockRpcServer],
                                                 tokenizer: TextTokenizer) -> None:
    resp = client(front).chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=40,
                                                 temperature=0.5, top_p=0.9, seed=11, stop=["zzz"])
    assert resp.choices[0].message.content == ANSWER
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(tokenizer.encode(ANSWER)) + 1
    sent = rtp_mock[1].requests[-1]   # what crossed the wire, in RTP-LLM's fields
    c = sent.generate_config
    assert list(sent.token_ids) and c.max_new_tokens == 40 and c.random_seed.value == 11
    assert (round(c.temperature, 3), round(c.top_p, 3), c.do_sample, c.is_streaming) == (0.5, 0.9, True, True)


def test_the_seed_mock_streams(front: MockFrontend) -> None:
    chunks = list(client(front).chat.completions.create(model="mock-model", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_health_counts_a_backend_without_grpc_health(front: MockFrontend) -> None:
    assert httpx.get(f"{front.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("extra,param", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                         ({"logit_bias": {"5": 1.0}}, "logit_bias"),
                                         ({"extra_body": {"min_p": 0.1}}, "min_p")])
def test_what_rtp_llm_cannot_carry_is_a_400(front: MockFrontend, extra: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(front).chat.completions.create(model="mock-model", messages=MESSAGES, **extra)  # type: ignore[call-overload]
    assert info.value.body["param"] == param and "rtp_llm" in info.value.body["message"]


def test_prompt_logprobs_need_a_call_rtp_llm_lacks(front: MockFrontend) -> None:
    """The score call is kvyard's own: an RTP-LLM backend answers UNIMPLEMENTED, the request a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        client(front).completions.create(model="mock-model", prompt="a b c", max_tokens=2,
                                         extra_body={"prompt_logprobs": 1})
    assert "does not serve this call" in info.value.body["message"]


def test_kvyards_own_backend_over_rtp_llm(tokenizer: TextTokenizer) -> None:
    with MockBackendThread(script(tokenizer, "Hi there")) as backend, \
            mock_frontend(tokenizer, backend.address, BACKEND_PROTOCOL="rtp_llm") as front:
        whole = client(front).chat.completions.create(model="mock-model", messages=MESSAGES)
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == ("Hi there", "stop")
        cut = client(front).chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=1)
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 1


def test_config_mapping_keeps_stops_and_seed() -> None:
    cfg = config_to_rtp(SamplingParams(max_new_tokens=8, seed=3, stop_token_ids=(7,), stop_sequences=((4, 5),),
                                       ignore_eos=True, timeout_ms=500))
    assert [list(r.values) for r in cfg.stop_words_list.rows] == [[4, 5], [7]]
    assert (cfg.random_seed.value, cfg.ignore_eos, cfg.timeout_ms, cfg.do_sample) == (3, True, 500, False)


def test_int32_tensor_layout() -> None:
    t = int32_tensor([1, 70000])
    assert list(t.shape) == [1, 2] and np.frombuffer(t.int32_data, "<i4").tolist() == [1, 70000]


def test_ids_outside_the_vocabulary_fail_the_request_saying_so(tokenizer: TextTokenizer) -> None:
    """A backend serving another model (the seed's mock sends Qwen2 ids, 151645, ...): the request ends
    with an error naming the cause, not an anonymous internal error."""
    port = free_port_block(1)
    server, _ = start(port, [151645, 151643])
    try:
        with mock_frontend(tokenizer, f"127.0.0.1:{port}", BACKEND_PROTOCOL="rtp_llm") as front:
            resp = httpx.post(f"{front.url}/v1/chat/completions", timeout=10,
                              json={"model": "mock-model", "messages": MESSAGES})
            assert resp.status_code == 500, resp.text
            message = resp.json()["error"]["message"]
            assert "token ids out of range" in message and "another vocabulary" in message
    finally:
        server.stop(0)
