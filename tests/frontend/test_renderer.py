"""BasicRenderer on the embedded tokenizer: faithful rendering, user templates, a sandbox that refuses."""
from __future__ import annotations

import copy
import json
import sys
import time
from typing import Any

import jinja2
import pytest

from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer
from renderers import ChatRenderer, RenderRequest, get_renderer, register_renderer
from renderers import basic
from renderers.basic import BasicRenderer

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Ünïcödé, 日本語 and <|im_end|> as text"}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def renderer(tokenizer: TextTokenizer) -> ChatRenderer:
    return get_renderer(None, tokenizer)


def plain_render(source: str, tokenizer: TextTokenizer, messages: list[dict[str, Any]],
                 add_generation_prompt: bool) -> str:
    """The same template through ordinary (non-sandboxed) jinja2, with HF's whitespace options."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=tokenizer.bos_token or "",
                                          eos_token=tokenizer.eos_token or "")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_model_template_matches_plain_jinja(renderer: ChatRenderer, tokenizer: TextTokenizer,
                                            messages: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    assert tokenizer.chat_template
    out = renderer.render(RenderRequest(messages=messages, add_generation_prompt=add_generation_prompt))
    assert out.prompt == plain_render(tokenizer.chat_template, tokenizer, messages, add_generation_prompt)
    assert out.template_source == "model"
    assert out.renderer == BasicRenderer.name
    assert out.input_ids == tokenizer.encode(out.prompt, parse_special=True)
    assert out.stop_words == ["<|im_end|>"]


def test_chatml_shape(renderer: ChatRenderer) -> None:
    out = renderer.render(RenderRequest(messages=[{"role": "system", "content": "S"},
                                                  {"role": "user", "content": "U"}]))
    assert out.prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert out.input_ids.count(2) == 2  # <|im_end|> parsed as the control token


def test_named_template_key(renderer: ChatRenderer, tokenizer: TextTokenizer) -> None:
    messages = CONVERSATIONS[0]
    out = renderer.render(RenderRequest(messages=messages, template_key="default"))
    assert out.template_source == "template_key:default"
    assert out.prompt == plain_render(tokenizer.chat_template or "", tokenizer, messages, True)
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=messages, template_key="no_such_template"))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert err.value.param == "template_key"


def test_user_template_is_used(renderer: ChatRenderer, tokenizer: TextTokenizer) -> None:
    source = ("{% for m in messages %}[{{ m.role | upper }}] {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}")
    messages = CONVERSATIONS[2]
    out = renderer.render(RenderRequest(messages=messages, user_template=source))
    assert out.template_source == "user_template"
    assert out.prompt == plain_render(source, tokenizer, messages, True)
    assert out.prompt.startswith("[USER] Hi\n[ASSISTANT] Hello.\n")
    assert out.prompt.endswith("[ASSISTANT]<|im_end|>")
    assert out.input_ids == tokenizer.encode(out.prompt, parse_special=True)


def test_user_template_helpers(renderer: ChatRenderer) -> None:
    out = renderer.render(RenderRequest(
        messages=[{"role": "user", "content": "x"}],
        user_template="{{ messages | tojson }}|{{ json.dumps(flag) }}|{{ flag }}",
        chat_template_kwargs={"flag": True}))
    assert out.prompt == '[{"role": "user", "content": "x"}]|true|True'


def test_user_template_with_template_key_is_invalid(renderer: ChatRenderer) -> None:
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=CONVERSATIONS[0], user_template="{{ messages }}",
                                      template_key="default"))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("source", ["{% for m in messages %}", "{{ messages[0] ", "{% endif %}"])
def test_user_template_that_does_not_compile(renderer: ChatRenderer, source: str) -> None:
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=CONVERSATIONS[0], user_template=source))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


def test_raise_exception_in_template_is_a_request_error(renderer: ChatRenderer) -> None:
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=CONVERSATIONS[0],
                                      user_template="{{ raise_exception('roles must alternate') }}"))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert "roles must alternate" in err.value.message


SSTI_PAYLOADS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('echo pwned').read() }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ messages.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages['__class__'] }}",
    "{{ messages | attr('__class__') }}",
    "{{ messages[0].__class__.__init__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__code__ }}",
    "{{ json.dumps.__globals__['sys'] }}",
    "{{ json.codecs.open('/etc/hostname').read() }}",
    "{{ json.encoder.re.enum.sys.modules.os.system('echo pwned') }}",
    "{% set x = messages.append({'role': 'user'}) %}",
    "{% set x = messages[0].update({'role': 'system'}) %}",
    "{{ bos_token.__len__() }}",
]


@pytest.mark.parametrize("payload", SSTI_PAYLOADS)
def test_ssti_is_refused(renderer: ChatRenderer, payload: str, capfd: pytest.CaptureFixture[str]) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as err:
        out = renderer.render(RenderRequest(messages=messages, user_template=payload))
        pytest.fail(f"rendered instead of refused: {out.prompt!r}")
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert messages == [{"role": "user", "content": "hi"}]  # not mutated
    assert "pwned" not in capfd.readouterr().out


def test_ssti_in_messages_is_only_text(renderer: ChatRenderer) -> None:
    payload = "{{ cycler.__init__.__globals__ }}{% raw %}x{% endraw %}"
    out = renderer.render(RenderRequest(messages=[{"role": "user", "content": payload}]))
    assert payload in out.prompt


def test_registry_unknown_model_type(tokenizer: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="no_such_family"):
        get_renderer("no_such_family", tokenizer)


@pytest.mark.parametrize("model_type", [None, "", "default", "llama", "smollm2", "qwen_2", "mistral"])
def test_registry_known_model_types(tokenizer: TextTokenizer, model_type: str | None) -> None:
    assert isinstance(get_renderer(model_type, tokenizer), BasicRenderer)


def test_registry_duplicate_name_raises() -> None:
    class Another(BasicRenderer):
        name = "another"

    with pytest.raises(ValueError, match="default"):
        register_renderer("default")(Another)
    with pytest.raises(ValueError, match="llama"):
        register_renderer("llama")(Another)


@pytest.mark.parametrize("payload", ["{{ 'x' * 10**10 }}", "{{ 'x' * 100000000 }}", "{{ [1] * 100000000 }}",
                                     "{{ 10 ** (10 ** 10) }}"])
def test_memory_bombs_are_refused(payload: str, tokenizer) -> None:
    renderer = BasicRenderer(tokenizer)
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=[{"role": "user", "content": "hi"}], user_template=payload))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


# ---- template selection order and tools ----------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def with_templates(tokenizer: TextTokenizer, templates: dict[str, str]) -> TextTokenizer:
    tok = copy.copy(tokenizer)
    tok.chat_templates = dict(templates)
    tok.chat_template = templates.get("default")
    return tok


SELECTION = {"default": "DEFAULT{{ messages[0]['content'] }}", "tool_use": "TOOL_USE{{ tools | length }}",
             "other": "OTHER"}


@pytest.mark.parametrize(("request_fields", "prompt", "source"), [
    ({}, "DEFAULThi", "model"),                                                        # 4. model default
    ({"tools": [WEATHER_TOOL]}, "TOOL_USE1", "template_key:tool_use"),                 # 3. tool_use for tools
    ({"template_key": "other", "tools": [WEATHER_TOOL]}, "OTHER", "template_key:other"),  # 2. template_key
    ({"user_template": "USER", "tools": [WEATHER_TOOL]}, "USER", "user_template"),     # 1. user_template
])
def test_template_selection_order(tokenizer: TextTokenizer, request_fields: dict[str, Any], prompt: str,
                                  source: str) -> None:
    renderer = BasicRenderer(with_templates(tokenizer, SELECTION))
    out = renderer.render(RenderRequest(messages=[{"role": "user", "content": "hi"}], **request_fields))
    assert (out.prompt, out.template_source) == (prompt, source)


def test_no_template_falls_back_to_chatml(tokenizer: TextTokenizer) -> None:
    renderer = BasicRenderer(with_templates(tokenizer, {}))
    out = renderer.render(RenderRequest(messages=[{"role": "user", "content": "hi"}]))
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.template_source == "fallback"


def test_tools_go_into_the_system_prompt_when_the_template_has_none(renderer: ChatRenderer) -> None:
    out = renderer.render(RenderRequest(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        tools=[WEATHER_TOOL]))
    assert out.tools_in_prompt
    system = out.prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER_TOOL) in system and "<tool_call>" in system
    assert out.prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # An existing system message keeps its text, the tools follow it.
    out = renderer.render(RenderRequest(messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL]))
    assert out.prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert out.prompt.count("<|im_start|>system") == 1


def test_earlier_calls_and_tool_results_are_written_as_the_model_writes_them(renderer: ChatRenderer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    ]
    out = renderer.render(RenderRequest(messages=messages, tools=[WEATHER_TOOL]))
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            '<|im_end|>') in out.prompt
    assert ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n"
            "</tool_response><|im_end|>") in out.prompt
    assert messages[2]["role"] == "tool"  # the request's own messages are not changed


def test_a_template_with_tool_support_gets_tools_and_argument_objects(tokenizer: TextTokenizer) -> None:
    source = ("{% if tools %}[{% for t in tools %}{{ t.function.name }}{% endfor %}]{% endif %}"
              "{% for m in messages %}{{ m.role }}:{{ m.content }}"
              "{% for c in m.tool_calls or [] %}<{{ c.function.name }} city={{ c.function.arguments.city }}>"
              "{% endfor %}|{% endfor %}")
    renderer = BasicRenderer(with_templates(tokenizer, {"default": source}))
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18 C"}]
    out = renderer.render(RenderRequest(messages=messages, tools=[WEATHER_TOOL]))
    assert out.prompt == "[get_weather]user:Paris?|assistant:<get_weather city=Paris>|tool:18 C|"
    assert not out.tools_in_prompt


def test_the_json_tool_format(tokenizer: TextTokenizer) -> None:
    renderer = get_renderer(None, tokenizer, "json")
    out = renderer.render(RenderRequest(messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER_TOOL],
                                        tool_choice="required"))
    assert "answer with only a JSON list" in out.prompt and "You must call at least one function." in out.prompt
    assert renderer.tool_parser.name == "json"
    with pytest.raises(ValueError, match="hermes"):
        get_renderer(None, tokenizer, "no_such_parser")


# ---- a template's work is bounded ---------------------------------------------------------------

BUDGET_BUSTERS = {
    "nested_loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x",
    "loops_over_a_string": "{% set s = 'ab' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "recursive_macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge_output": "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
}


@pytest.mark.parametrize("case", sorted(BUDGET_BUSTERS))
def test_template_work_is_bounded(renderer: ChatRenderer, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these held a frontend thread for minutes (or for ever, or took gigabytes): now a 400
    within the render budget."""
    monkeypatch.setattr(basic, "RENDER_TIME_LIMIT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=CONVERSATIONS[0], user_template=BUDGET_BUSTERS[case]))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert any(word in err.value.message for word in ("budget", "recursed", "more than"))
    assert time.monotonic() - start < 3.0
    assert sys.gettrace() is None  # the budget's trace function is gone again


def test_a_bounded_render_equals_an_ordinary_one(renderer: ChatRenderer, tokenizer: TextTokenizer) -> None:
    loops = "{% for m in messages %}{% for i in range(3) %}{{ m['content'] }}{{ i }}{% endfor %}{% endfor %}"
    for messages in CONVERSATIONS:
        got = renderer.render(RenderRequest(messages=messages, user_template=loops)).prompt
        assert got == plain_render(loops, tokenizer, messages, True)


SIZE_BOMBS = [
    "{% for i in range(10**9) %}x{% endfor %}",     # the sandbox's own range limit (OverflowError)
    "{{ 1/0 }}",
    "{{ 'ab'|center(10**9) }}",
    "{{ 'a\nb'|indent(10**8) }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '%99999999d'|format(3) }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ messages|tojson(indent=10**8) }}",
]


@pytest.mark.parametrize("source", SIZE_BOMBS)
def test_size_bombs_and_template_crashes_are_400s(renderer: ChatRenderer, source: str) -> None:
    """Each used to be a 500 or a gigabyte string: now a 400 before anything big is built."""
    with pytest.raises(RequestError) as err:
        renderer.render(RenderRequest(messages=CONVERSATIONS[0], user_template=source))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


def test_ordinary_formatting_still_works(renderer: ChatRenderer) -> None:
    source = "{{ '{:>5}'.format('x') }}|{{ '%3s' % 'y' }}|{{ 'ab'|center(6) }}|{{ '%s-%2d'|format('a', 3) }}"
    assert renderer.render(RenderRequest(messages=CONVERSATIONS[0], user_template=source)).prompt == \
        "    x|  y|  ab  |a- 3"


def test_templates_get_the_whole_special_tokens_map(renderer: ChatRenderer) -> None:
    """As transformers' apply_chat_template and RTP-LLM's renderers: every special token by its name."""
    source = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ additional_special_tokens[0] }}"
    out = renderer.render(RenderRequest(messages=[{"role": "user", "content": "U"}], user_template=source))
    assert out.prompt == "<|im_start|>|<|im_end|>|<|endoftext|>|<|im_end|>|<repo_name>"
