"""BasicRenderer on the embedded tokenizer: faithful rendering, user templates, a sandbox that refuses."""
from __future__ import annotations

from typing import Any

import jinja2
import pytest

from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer
from renderers import ChatRenderer, RenderRequest, get_renderer, register_renderer
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
