"""Conformance: the official OpenAI client over every request field kvyard knows (OpenAI's own, vLLM's and
llama.cpp's extensions through extra_body), against an in-process frontend and the product mock backend.
Each field is shown to take effect (in the answer, or in the GenerateConfigPB the backend received), or to be
refused with a 400 naming it; a field nobody knows is OpenAI's 400 "Unrecognized request argument"
(docs/api.md#request-fields). The sampler's side of min_tokens, allowed_token_ids, bad_words and typical_p
is in tests/backend/test_sampler_bans.py."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from backend.mock_backend import mock_logprob
from kvyard.tokenizer import TextTokenizer
from tests.support.mock_stack import MockBackendThread, MockFrontend, mock_frontend, script

TEXT = "Hello there, friend!"
EOS = 2   # <|im_end|>
MODEL = "mock-model"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def mock(tokenizer: TextTokenizer) -> Iterator[MockBackendThread]:
    with MockBackendThread(script(tokenizer, TEXT)) as backend:
        yield backend


@pytest.fixture(scope="module")
def trusted(tokenizer: TextTokenizer, mock: MockBackendThread) -> Iterator[MockFrontend]:
    with mock_frontend(tokenizer, mock.address, TRUST_REQUEST_CHAT_TEMPLATE="1") as f:
        yield f


def sent(mock: MockBackendThread) -> Any:
    return mock.servicer.requests[-1].generate_config


def refused(call: Any, field: str, needle: str = "") -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == field, err
    assert needle in err["message"], err


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", HI), **kw)


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", "Say hi"), **kw)


# ---- the unknown-field policy ---------------------------------------------------------------------

def test_an_unknown_field_is_refused_by_name(client: openai.OpenAI) -> None:
    for call in (lambda: chat(client, extra_body={"frobnicate": 1}),
                 lambda: complete(client, extra_body={"frobnicate": 1})):
        refused(call, "frobnicate", "Unrecognized request argument supplied: frobnicate")
    refused(lambda: chat(client, messages=[{"role": "user", "content": "x", "colour": "red"}]),
            "messages.0.colour", "Unrecognized request argument")


def test_the_clients_own_descriptive_fields_are_taken(client: openai.OpenAI) -> None:
    resp = chat(client, user="u-1", metadata={"k": "v"}, store=False, service_tier="auto",
                parallel_tool_calls=True, stream_options=None, modalities=["text"])
    assert resp.choices[0].message.content == TEXT
    refused(lambda: chat(client, store=True), "store", "keeps no outputs")
    refused(lambda: chat(client, service_tier="flex"), "service_tier")


def test_a_returned_message_can_be_sent_back_as_it_came(client: openai.OpenAI) -> None:
    first = chat(client).choices[0].message
    resp = chat(client, messages=[*HI, first.model_dump(), {"role": "user", "content": "More"}])
    assert resp.choices[0].message.content == TEXT


# ---- vLLM's fields, each with its effect ----------------------------------------------------------

def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI, mock: MockBackendThread) -> None:
    plain = complete(client, max_tokens=40)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 40
    resp = complete(client, max_tokens=40, extra_body={"ignore_eos": True})
    assert sent(mock).ignore_eos and resp.usage.completion_tokens == 40
    assert resp.choices[0].finish_reason == "length"
    chat(client, max_tokens=40, extra_body={"ignore_eos": True})
    assert sent(mock).ignore_eos


def test_min_tokens_and_stop_token_ids(client: openai.OpenAI, tokenizer: TextTokenizer,
                                       mock: MockBackendThread) -> None:
    chat(client, extra_body={"min_tokens": 5})
    assert sent(mock).min_new_tokens == 5
    second = tokenizer.encode(TEXT)[1]
    resp = complete(client, extra_body={"stop_token_ids": [second]})
    assert list(sent(mock).stop_token_ids) == [second]
    assert resp.usage.completion_tokens == 2 and resp.choices[0].finish_reason == "stop"
    # vLLM's stop_reason: the stop token id (or stop string) that ended the choice; None for eos or length
    assert resp.choices[0].model_extra["stop_reason"] == second
    assert chat(client, extra_body={"stop_token_ids": [second]}).choices[0].model_extra["stop_reason"] == second
    chunks = list(chat(client, stream=True, extra_body={"stop_token_ids": [second]}))
    assert [c.choices[0].model_extra.get("stop_reason") for c in chunks if c.choices[0].finish_reason] == [second]
    streamed = [c.choices[0] for c in complete(client, stream=True, extra_body={"stop_token_ids": [second]})]
    assert streamed[-1].finish_reason == "stop" and streamed[-1].model_extra["stop_reason"] == second
    assert complete(client, stop=["there"]).choices[0].model_extra["stop_reason"] == "there"
    assert chat(client).choices[0].model_extra["stop_reason"] is None   # eos
    assert complete(client, max_tokens=1).choices[0].model_extra["stop_reason"] is None   # length


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    assert complete(client, stop=["there"]).choices[0].text == "Hello "
    resp = complete(client, stop=["there"], extra_body={"include_stop_str_in_output": True})
    assert resp.choices[0].text == "Hello there"
    assert chat(client, stop="there", extra_body={"no_stop_trim": True}).choices[0].message.content == "Hello there"


def test_skip_special_tokens_false_shows_them(client: openai.OpenAI) -> None:
    assert complete(client).choices[0].text == TEXT
    assert complete(client, extra_body={"skip_special_tokens": False}).choices[0].text == TEXT + "<|im_end|>"
    refused(lambda: complete(client, extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": True}),
            "spaces_between_special_tokens")
    complete(client, extra_body={"spaces_between_special_tokens": True})   # nothing special to space out


def test_truncate_prompt_tokens_keeps_the_last(client: openai.OpenAI, tokenizer: TextTokenizer,
                                               mock: MockBackendThread) -> None:
    prompt = "one two three four five six seven"
    ids = tokenizer.encode(prompt)
    resp = complete(client, prompt=prompt, extra_body={"truncate_prompt_tokens": 3})
    assert resp.usage.prompt_tokens == 3 and list(mock.servicer.requests[-1].token_ids) == ids[-3:]


def test_prompt_logprobs(client: openai.OpenAI, tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("Say hi")
    resp = complete(client, extra_body={"prompt_logprobs": 2}).model_dump()
    lps = resp["choices"][0]["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    for token, entry in zip(ids[1:], lps[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(mock_logprob(token))
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
    body = chat(client, extra_body={"prompt_logprobs": 0}).model_dump()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 1
    refused(lambda: chat(client, stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs")


def test_allowed_token_ids_bad_words_typical_p_reach_the_sampler(client: openai.OpenAI, tokenizer: TextTokenizer,
                                                                 mock: MockBackendThread) -> None:
    chat(client, extra_body={"allowed_token_ids": [5, 6, EOS], "bad_words": ["friend"], "typical_p": 0.5})
    cfg = sent(mock)
    assert list(cfg.allowed_token_ids) == [5, 6, EOS] and cfg.typical_p == pytest.approx(0.5)
    words = {tuple(w.ids) for w in cfg.bad_words_ids}
    assert tuple(tokenizer.encode("friend")) in words and tuple(tokenizer.encode(" friend")) in words
    refused(lambda: chat(client, extra_body={"allowed_token_ids": [10**9]}), "allowed_token_ids")


def test_best_of_ranks_candidates(client: openai.OpenAI, mock: MockBackendThread) -> None:
    from frontend.completions import best_candidates
    resp = complete(client, n=1, best_of=3)
    cfg = sent(mock)
    assert cfg.num_return_sequences == 3 and cfg.return_logprobs        # three drawn, ranked by logprob
    assert len(resp.choices) == 1 and resp.choices[0].text == TEXT and resp.choices[0].logprobs is None
    assert resp.usage.completion_tokens == 3 * len(mock.servicer.script.token_ids)
    assert best_candidates([-3.0, -1.0, -2.0], 2) == [1, 2]
    assert len(complete(client, n=2, best_of=2).choices) == 2
    refused(lambda: complete(client, n=1, best_of=3, stream=True), "best_of", "streamed")
    refused(lambda: chat(client, n=1, extra_body={"best_of": 3}), "best_of")


def test_priority_and_other_partly_served_fields(client: openai.OpenAI) -> None:
    chat(client, extra_body={"priority": 0})
    refused(lambda: chat(client, extra_body={"priority": 1}), "priority", "not enabled")
    refused(lambda: chat(client, extra_body={"structural_tag": "{}"}), "structural_tag")
    refused(lambda: chat(client, extra_body={"guided_whitespace_pattern": " "}), "guided_whitespace_pattern")
    refused(lambda: chat(client, extra_body={"guided_decoding_backend": "outlines"}), "guided_decoding_backend")
    chat(client, extra_body={"guided_decoding_backend": "guidance"})
    refused(lambda: chat(client, extra_body={"return_hidden_states": True}), "return_hidden_states")


def test_return_tokens_as_token_ids(client: openai.OpenAI, tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    resp = chat(client, logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    assert [e.token for e in resp.choices[0].logprobs.content][:len(ids)] == [f"token_id:{i}" for i in ids]
    lp = complete(client, logprobs=1, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert lp.tokens[:len(ids)] == [f"token_id:{i}" for i in ids]


def test_chat_template_needs_the_operators_trust(client: openai.OpenAI, trusted: MockFrontend,
                                                 http: httpx.Client) -> None:
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}{% for d in documents %}<{{ d.text }}>{% endfor %}"
    body = {"chat_template": template, "documents": [{"text": "doc1"}]}
    refused(lambda: chat(client, extra_body=body), "chat_template", "TRUST_REQUEST_CHAT_TEMPLATE")
    rendered = httpx.post(f"{trusted.url}/v1/chat/render", json={"messages": HI, **body}).json()
    assert rendered["input_prompt"] == "[Hi]<doc1>"
    kwargs = {"chat_template": "{{ greeting }}", "chat_template_kwargs": {"greeting": "hey"}}
    assert httpx.post(f"{trusted.url}/v1/chat/render", json={"messages": HI, **kwargs}).json()["input_prompt"] == "hey"


def test_add_generation_prompt_and_continue_final_message(http: httpx.Client, client: openai.OpenAI) -> None:
    turns = [*HI, {"role": "assistant", "content": "Hello, I am"}]
    with_prompt = http.post("/v1/chat/render", json={"messages": HI}).json()["input_prompt"]
    without = http.post("/v1/chat/render", json={"messages": HI, "add_generation_prompt": False}).json()["input_prompt"]
    assert with_prompt.startswith(without) and with_prompt != without
    cont = http.post("/v1/chat/render", json={"messages": turns, "add_generation_prompt": False,
                                              "continue_final_message": True}).json()
    assert cont["input_prompt"].endswith("Hello, I am")
    refused(lambda: chat(client, messages=turns, extra_body={"continue_final_message": True}), "continue_final_message")


# ---- llama.cpp's fields ---------------------------------------------------------------------------

def test_llama_cpp_fields(client: openai.OpenAI, mock: MockBackendThread) -> None:
    resp = complete(client, extra_body={"n_predict": 3})
    assert sent(mock).max_new_tokens == 3 and resp.usage.completion_tokens == 3
    chat(client, extra_body={"n_predict": 4})
    assert sent(mock).max_new_tokens == 4
    refused(lambda: complete(client, max_tokens=5, extra_body={"n_predict": 3}), "n_predict")
    resp = chat(client, extra_body={"n_probs": 2})
    assert sent(mock).top_logprobs == 2 and len(resp.choices[0].logprobs.content[0].top_logprobs) == 2
    assert complete(client, extra_body={"n_probs": 1}).choices[0].logprobs is not None
    chat(client, extra_body={"cache_prompt": True, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1})
    refused(lambda: chat(client, extra_body={"cache_prompt": False}), "cache_prompt")
    refused(lambda: chat(client, extra_body={"mirostat": 2}), "mirostat")
    refused(lambda: chat(client, extra_body={"samplers": ["top_k", "temperature"]}), "samplers")
