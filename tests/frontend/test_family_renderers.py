"""MODEL_TYPE renderers for families whose templates need help with tools: Llama 3 (JSON calls with
"parameters", results in ipython turns), Qwen2.5 (<tool_call> blocks, <tool_response> results) and Mistral
([INST] turns, [AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]), on tokenizers of those families built in
tests/support/tiny_models.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvyard.tokenizer import TextTokenizer
from renderers import RenderRequest, get_renderer
from renderers.llama3 import LLAMA3_TEMPLATE, Llama3Renderer
from renderers.mistral import MistralRenderer, MistralToolParser
from renderers.qwen2 import Qwen25Renderer
from tests.support.tiny_tokenizers import (LLAMA3_SPECIALS, QWEN2_SPECIALS, TokenizerSpec, byte_level_tokenizer,
                                           save_hf_tokenizer, sentencepiece_tokenizer)

MISTRAL_SPECIALS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
]


def hf_tokenizer(spec: TokenizerSpec, path: Path, template: str | None) -> TextTokenizer:
    path.mkdir()
    save_hf_tokenizer(spec, path, template)
    return TextTokenizer.from_path(path)


@pytest.fixture(scope="module")
def llama3_spec() -> TokenizerSpec:
    spec = byte_level_tokenizer("llama-bpe", specials=LLAMA3_SPECIALS)
    spec.specials = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>"}
    return spec


@pytest.fixture(scope="module")
def qwen_spec() -> TokenizerSpec:
    spec = byte_level_tokenizer("qwen2", specials=QWEN2_SPECIALS, user_defined=("<tool_call>", "</tool_call>"))
    spec.specials = {"eos": "<|im_end|>"}
    return spec


@pytest.fixture(scope="module")
def mistral_spec() -> TokenizerSpec:
    return sentencepiece_tokenizer(extra_specials=MISTRAL_SPECIALS)


def test_registered_by_name(llama3_spec: TokenizerSpec, tmp_path: Path) -> None:
    tok = hf_tokenizer(llama3_spec, tmp_path / "t", None)
    assert isinstance(get_renderer("llama3", tok), Llama3Renderer)
    assert isinstance(get_renderer("llama3.1", tok), Llama3Renderer)
    assert isinstance(get_renderer("qwen2.5", tok), Qwen25Renderer)
    assert get_renderer("llama3", tok).tool_parser.name == "json"
    assert get_renderer("qwen2.5", tok).tool_parser.name == "hermes"


def test_llama3_tools_without_template_support(llama3_spec: TokenizerSpec, tmp_path: Path) -> None:
    """A Llama 3 template with no tools: functions in the system turn, the earlier call as Llama 3.1's
    JSON, the result in an ipython turn; the answer parses back into a call."""
    tok = hf_tokenizer(llama3_spec, tmp_path / "t", LLAMA3_TEMPLATE)
    renderer = get_renderer("llama3", tok)
    out = renderer.render(RenderRequest(messages=HISTORY, tools=TOOLS))
    assert out.prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert '"name": "get_weather"' in out.prompt and '"parameters"' in out.prompt
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n'
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>') in out.prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18 C, sunny<|eot_id|>" in out.prompt
    assert out.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert out.tools_in_prompt and out.stop_words == ["<|eot_id|>", "<|eom_id|>"]
    assert out.input_ids[0] == llama3_spec.id("<|begin_of_text|>")
    for answer in ('{"name": "get_weather", "parameters": {"city": "Rome"}}',
                   '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'):
        events = renderer.tool_parser().parse(answer)
        assert [(e.call.name, json.loads(e.call.arguments)) for e in events if e.call] == [("get_weather", {"city": "Rome"})]


def test_llama3_template_with_tools_gets_them(llama3_spec: TokenizerSpec, tmp_path: Path) -> None:
    template = LLAMA3_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}{% if tools %}TOOLS:{{ tools | length }}{% endif %}")
    tok = hf_tokenizer(llama3_spec, tmp_path / "t", template)
    out = get_renderer("llama3", tok).render(RenderRequest(messages=HISTORY[:1], tools=TOOLS))
    assert "TOOLS:1" in out.prompt and not out.tools_in_prompt


def test_llama3_fallback_template(llama3_spec: TokenizerSpec, tmp_path: Path) -> None:
    tok = hf_tokenizer(llama3_spec, tmp_path / "t", None)
    out = get_renderer("llama3", tok).render(RenderRequest(messages=[{"role": "user", "content": "Hi"}]))
    assert out.template_source == "fallback"
    assert out.prompt == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen25_tools_on_a_plain_chatml_template(qwen_spec: TokenizerSpec, tmp_path: Path) -> None:
    """No template shipped: Qwen2.5's turns, default system prompt with the tools, <tool_call> history,
    the result as a <tool_response> user turn; <tool_call> is one token (user-defined)."""
    tok = hf_tokenizer(qwen_spec, tmp_path / "t", None)
    renderer = get_renderer("qwen2.5", tok)
    out = renderer.render(RenderRequest(messages=HISTORY, tools=TOOLS))
    assert out.prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in out.prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in out.prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert qwen_spec.id("<tool_call>") in out.input_ids
    assert out.stop_words == ["<|im_end|>", "<|endoftext|>"]
    events = renderer.tool_parser().parse('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert events[0].text == "Sure.\n" and events[1].call is not None and events[1].call.name == "get_weather"


def test_token_bytes_of_each_vocabulary_style(qwen_spec: TokenizerSpec, tmp_path: Path) -> None:
    """OpenAI's logprobs `bytes`: byte-level pieces and SentencePiece's ▁ and <0xNN> pieces alike."""
    tok = hf_tokenizer(qwen_spec, tmp_path / "q", None)
    text = "héllo 日本"
    raw = b"".join(tok.token_bytes(i) or b"" for i in tok.encode(text))
    assert raw == text.encode()
    assert tok.token_bytes(qwen_spec.id("<|im_end|>")) is None
    spm = sentencepiece_tokenizer()
    spm_tok = hf_tokenizer(spm, tmp_path / "s", None)
    assert spm_tok.token_bytes(spm.id("<0xE6>")) == b"\xe6"
    ids = spm_tok.encode("a 日")
    assert b"".join(spm_tok.token_bytes(i) or b"" for i in ids) == " a 日".encode()


def test_mistral_registered_with_its_own_call_format(mistral_spec: TokenizerSpec, tmp_path: Path) -> None:
    renderer = get_renderer("mistral", hf_tokenizer(mistral_spec, tmp_path / "t", None))
    assert isinstance(renderer, MistralRenderer) and renderer.tool_parser is MistralToolParser


def test_mistral_fallback_template_folds_the_system_prompt_into_the_user_turn(mistral_spec: TokenizerSpec,
                                                                             tmp_path: Path) -> None:
    tok = hf_tokenizer(mistral_spec, tmp_path / "t", None)
    out = get_renderer("mistral", tok).render(RenderRequest(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]))
    assert out.template_source == "fallback"
    assert out.prompt == "<s>[INST] Be brief.\n\nHi[/INST]Hello.</s>[INST] Bye[/INST]"
    assert out.input_ids[:2] == [mistral_spec.id("<s>"), mistral_spec.id("[INST]")]


def test_mistral_tools_without_template_support(mistral_spec: TokenizerSpec, tmp_path: Path) -> None:
    """No template shipped: the tools in [AVAILABLE_TOOLS] in front of the first user turn, the earlier
    call as [TOOL_CALLS] [...], the result in [TOOL_RESULTS]; each marker is one special token, and the
    answer's calls parse with or without the [TOOL_CALLS] prefix."""
    tok = hf_tokenizer(mistral_spec, tmp_path / "t", None)
    renderer = get_renderer("mistral", tok)
    out = renderer.render(RenderRequest(messages=HISTORY, tools=TOOLS))
    assert out.prompt.startswith("<s>[INST] [AVAILABLE_TOOLS] " + json.dumps(TOOLS) + "[/AVAILABLE_TOOLS]\n")
    assert '[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>' in out.prompt
    assert out.prompt.endswith('[INST] [TOOL_RESULTS] {"content": "18 C, sunny"}[/TOOL_RESULTS][/INST]')
    assert out.tools_in_prompt
    for marker in ("[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"):
        assert mistral_spec.id(marker) in out.input_ids, marker
    for answer in ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]',
                   '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'):
        events = renderer.tool_parser().parse(answer)
        assert [(e.call.name, json.loads(e.call.arguments)) for e in events if e.call] == [("get_weather", {"city": "Rome"})]
