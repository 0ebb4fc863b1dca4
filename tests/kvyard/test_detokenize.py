"""IncrementalDetokenizer: streamed chunks never split a character and always add up to decode(ids)."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvyard.detokenize import IncrementalDetokenizer
from kvyard.model_path import embedded_model_path
from kvyard.tokenizer import TextTokenizer

FFFD = "\ufffd"
SLOW_OK = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_path(embedded_model_path())


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int] | None = None) -> list[str]:
    """Push ids in groups of `sizes` (cycled; one at a time by default), then flush."""
    chunks: list[str] = []
    sizes = sizes or [1]
    i = k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        chunks.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
    chunks.append(detok.flush())
    return chunks


def test_multibyte_one_token_at_a_time(tok: TextTokenizer) -> None:
    text = "héllo 你好 🤖🚀 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the emoji really are split across byte tokens
    detok = IncrementalDetokenizer(tok)
    chunks = _stream(detok, ids)
    assert "".join(chunks) == text
    assert detok.text == text
    assert all(FFFD not in c for c in chunks)
    assert chunks[-1] == ""  # nothing was left for flush
    assert "" in chunks  # some pushes completed no character


def test_leading_spaces_are_kept(tok: TextTokenizer) -> None:
    text = "Hello world  two   spaces\n indented"
    chunks = _stream(IncrementalDetokenizer(tok), tok.encode(text))
    assert "".join(chunks) == text
    assert " world" in chunks


def test_prompt_context_keeps_leading_space(tok: TextTokenizer) -> None:
    prompt = tok.encode("<|im_start|>assistant\nThe answer is", parse_special=True)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert detok.text == ""  # the prompt is context only, never emitted
    assert detok.push(tok.encode(" forty")) == " forty"
    assert detok.push(tok.encode(" two")) == " two"
    assert detok.flush() == ""
    assert detok.text == " forty two"


def test_prompt_ending_mid_character(tok: TextTokenizer) -> None:
    ids = tok.encode("a 🤖")
    # The generated id completes the prompt's last character: it is emitted whole, once.
    completed = IncrementalDetokenizer(tok, prompt_ids=ids[:-1])
    assert completed.push(ids[-1:]) == "🤖"
    assert completed.push(tok.encode(" ok")) == " ok"
    # Not completed: the prompt's broken bytes stay with the prompt and no U+FFFD is emitted.
    broken = IncrementalDetokenizer(tok, prompt_ids=ids[:-1])
    assert broken.push(tok.encode(" ok")) == " ok"
    assert broken.flush() == ""


def test_push_several_ids_at_once(tok: TextTokenizer) -> None:
    text = "Grüße aus 東京! 🎉 Numbers 12345."
    ids = tok.encode(text)
    for sizes in ([2], [3, 1], [len(ids)]):
        chunks = _stream(IncrementalDetokenizer(tok), ids, sizes)
        assert "".join(chunks) == text
        assert all(FFFD not in c for c in chunks)


def test_flush_incomplete_character_gives_replacement(tok: TextTokenizer) -> None:
    ids = tok.encode("ok 🤖")
    detok = IncrementalDetokenizer(tok)
    pushed = detok.push(ids[:-1])  # the robot's last byte never arrives
    assert FFFD not in pushed and pushed == "ok"
    tail = detok.flush()
    assert tail.startswith(" ") and tail.endswith(FFFD)
    assert detok.text == tok.decode(ids[:-1])
    assert detok.flush() == ""  # flushing twice emits nothing new


def test_special_tokens_skipped(tok: TextTokenizer) -> None:
    ids = tok.encode("Hi there<|im_end|>\n<|im_start|>user", parse_special=True)
    skipped = _stream(IncrementalDetokenizer(tok, skip_special_tokens=True), ids)
    assert "".join(skipped) == "Hi there\nuser"
    kept = _stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)
    assert "".join(kept) == "Hi there<|im_end|>\n<|im_start|>user"


def test_special_token_between_bytes_of_a_character(tok: TextTokenizer) -> None:
    robot = tok.encode("🤖")
    ids = [robot[0], 2, *robot[1:]]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert [detok.push([i]) for i in ids][-1] == "🤖"
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == "🤖"


def test_out_of_range_id_raises_and_leaves_state_intact(tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("Hello")) == "Hello"
    with pytest.raises(ValueError, match="out of range"):
        detok.push([tok.vocab_size])
    assert detok.push(tok.encode(" again")) == " again"
    assert detok.text == "Hello again"


def test_empty_push_and_flush(tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push([]) == "" and detok.flush() == "" and detok.text == ""


@SLOW_OK
@given(
    text=st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
)
def test_stream_equals_decode_of_text(tok: TextTokenizer, text: str, sizes: list[int]) -> None:
    ids = tok.encode(text)
    chunks = _stream(IncrementalDetokenizer(tok), ids, sizes)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) == expected
    if FFFD not in expected:
        assert all(FFFD not in c for c in chunks)


@SLOW_OK
@given(
    ids=st.lists(
        st.one_of(st.integers(0, 49151), st.integers(0, 20), st.integers(100, 260)),  # control ids, byte tokens
        max_size=30,
    ),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    skip=st.booleans(),
)
def test_stream_equals_decode_of_arbitrary_ids(tok: TextTokenizer, ids: list[int], sizes: list[int], skip: bool) -> None:
    # Arbitrary ids include invalid UTF-8 byte sequences: the stream must still add up to decode(ids).
    chunks = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, sizes)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)


@SLOW_OK
@given(
    text=st.text(alphabet=st.characters(codec="utf-8"), max_size=30),
    split=st.integers(0, 100),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
)
def test_stream_after_prompt_split_anywhere(tok: TextTokenizer, text: str, split: int, sizes: list[int]) -> None:
    ids = tok.encode(text)
    k = min(split, len(ids))
    full = tok.decode(ids)
    # What the prompt alone already shows: its text up to any character the generated ids complete.
    shown = os.path.commonprefix([tok.decode(ids[:k]), full])
    chunks = _stream(IncrementalDetokenizer(tok, prompt_ids=ids[:k]), ids[k:], sizes)
    assert shown + "".join(chunks) == full
