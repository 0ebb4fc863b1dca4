"""TextTokenizer against llama.cpp's golden ids, round-trip properties, HF dirs and error paths."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvyard.model_path import ModelFileError, embedded_model_path
from kvyard.tokenizer import TextTokenizer

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "smollm2_tokenizer.jsonl"
GOLDEN_ROWS: list[dict[str, Any]] = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines()]
SPECIAL_STRINGS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"]

# SmolLM2's vocab lacks the byte-level tokens for these bytes, so BPE drops them (as llama.cpp cannot
# tokenize them either): six C0 controls, the UTF-8 lead bytes of planes 4-11 (F1, F2), and bytes that
# never occur in valid UTF-8. Text containing them cannot round-trip.
MISSING_BYTES = frozenset({0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)})


def _representable(ch: str) -> bool:
    return not MISSING_BYTES.intersection(ch.encode("utf-8"))


# Arbitrary Unicode (no surrogates) minus the characters above.
any_text = st.text(alphabet=st.characters(codec="utf-8").filter(_representable))
# Text built from pieces that stress the pre-tokenizer: digits, runs of spaces, contractions,
# multi-byte characters and fragments of control-token strings.
tricky_text = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(codec="utf-8").filter(_representable), max_size=12),
        st.sampled_from(
            [*SPECIAL_STRINGS, "<|", "|>", "im_end", " ", "  ", "\n", "\t", "123", " 4", "'s", "'LL", "é", "你好", "🤖", "\u00a0"]
        ),
    ),
    max_size=8,
).map("".join)


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_path(embedded_model_path())


@pytest.fixture(scope="module")
def hf_dir(tok: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hf_tokenizer")
    tok.save(d / "tokenizer.json")
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},  # the serialized-AddedToken form
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "tools: {{ tools }}"},
        ],
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def hf_tok(hf_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_path(hf_dir)


def _golden_params() -> list[Any]:
    return [pytest.param(row, id=f"row{i}") for i, row in enumerate(GOLDEN_ROWS)]


def test_golden_file_is_complete() -> None:
    assert len(GOLDEN_ROWS) == 345
    assert sum(1 for r in GOLDEN_ROWS if r.get("special")) == 1


@pytest.mark.parametrize("row", _golden_params())
def test_golden_encode_and_decode(tok: TextTokenizer, row: dict[str, Any]) -> None:
    assert tok.encode(row["text"], parse_special=bool(row.get("special"))) == row["ids"]
    assert tok.decode(row["ids"]) == row["text"]


def test_golden_from_hf_dir(hf_tok: TextTokenizer) -> None:
    for row in GOLDEN_ROWS:
        assert hf_tok.encode(row["text"], parse_special=bool(row.get("special"))) == row["ids"], row["text"]
        assert hf_tok.decode(row["ids"]) == row["text"]


def assert_smollm2_vocabulary(tok: TextTokenizer) -> None:
    """What the GGUF's metadata and the Hugging Face directory's files both say of SmolLM2's vocabulary."""
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.add_bos_token is False
    assert tok.special_token_ids == frozenset(range(17))


def test_gguf_metadata(tok: TextTokenizer) -> None:
    assert_smollm2_vocabulary(tok)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.chat_templates == {"default": tok.chat_template}


def test_hf_dir_metadata(hf_tok: TextTokenizer) -> None:
    assert_smollm2_vocabulary(hf_tok)
    assert hf_tok.chat_template == "{{ messages[0]['content'] }}"
    assert hf_tok.chat_templates == {"default": "{{ messages[0]['content'] }}", "tool_use": "tools: {{ tools }}"}


def test_hf_dir_string_template_and_add_bos(tok: TextTokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path / "tokenizer.json")
    config = {"chat_template": "T", "add_bos_token": True, "bos_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    t = TextTokenizer.from_path(str(tmp_path))
    assert t.chat_template == "T" and t.chat_templates == {"default": "T"}
    assert t.add_bos_token is True and t.bos_token_id == 0
    assert t.eos_token_id is None and t.eos_token is None
    assert t.encode("hi") == tok.encode("hi")  # encode never adds BOS itself


def test_hf_dir_without_config(tok: TextTokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path / "tokenizer.json")
    t = TextTokenizer.from_path(tmp_path)
    assert t.chat_template is None and t.chat_templates == {}
    assert t.bos_token_id is None and t.add_bos_token is False


def test_im_end_in_user_text_is_plain_text(tok: TextTokenizer) -> None:
    plain = tok.encode("<|im_end|>", parse_special=False)
    assert 2 not in plain and len(plain) > 1
    assert tok.encode("<|im_end|>", parse_special=True) == [2]
    assert tok.decode(plain) == "<|im_end|>"


def test_decode_skip_special_tokens(tok: TextTokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>", parse_special=True)
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"


def test_encode_with_offsets(tok: TextTokenizer) -> None:
    text = "Hello world 42 é"
    ids, pieces, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert pieces == [tok.id_to_piece(i) for i in ids]
    assert pieces[:2] == ["Hello", "Ġworld"]
    assert offsets[:2] == [(0, 5), (5, 11)]
    assert offsets[-1][1] == len(text)
    special_ids, special_pieces, _ = tok.encode_with_offsets("<|im_end|>x", parse_special=True)
    assert special_ids[0] == 2 and special_pieces[0] == "<|im_end|>"


@pytest.mark.parametrize("bad", [49152, 10**9, -1])
def test_out_of_range_ids_raise(tok: TextTokenizer, bad: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([1, bad])
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_piece(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(any_text, tricky_text))
def test_round_trip_plain(tok: TextTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text, parse_special=False)) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(any_text, tricky_text))
def test_round_trip_parse_special(tok: TextTokenizer, text: str) -> None:
    assume(not any(tok.id_to_piece(i) in text for i in tok.special_token_ids))
    ids = tok.encode(text, parse_special=True)
    assert not tok.special_token_ids & set(ids)
    assert tok.decode(ids) == text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable-character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def test_missing_byte_tokens_are_dropped(tok: TextTokenizer) -> None:
    pieces = {tok.id_to_piece(i) for i in range(tok.vocab_size)}
    assert {b for b, ch in _bytes_to_unicode().items() if ch not in pieces} == MISSING_BYTES
    assert tok.encode("\x04") == []
    assert tok.decode(tok.encode("x\x04y")) == "xy"
    # A plane-4 character loses its lead byte; its continuation bytes decode as replacement characters.
    assert tok.decode(tok.encode("\U00040000")) == "\ufffd" * 3


def test_concurrent_modes_do_not_interfere(tok: TextTokenizer) -> None:
    text = "a <|im_end|> b " * 50
    expected = {False: tok.encode(text, False), True: tok.encode(text, True)}
    errors: list[str] = []

    def worker(parse_special: bool) -> None:
        for _ in range(200):
            if tok.encode(text, parse_special) != expected[parse_special]:
                errors.append(f"parse_special={parse_special}")

    threads = [threading.Thread(target=worker, args=(i % 2 == 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_load_logs_one_line(caplog: pytest.LogCaptureFixture, hf_dir: Path) -> None:
    with caplog.at_level(logging.INFO, logger="kvyard.tokenizer"):
        TextTokenizer.from_path(hf_dir)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvyard.tokenizer"]
    assert len(lines) == 1
    assert str(hf_dir) in lines[0] and "49152" in lines[0]


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="does not exist") as e:
        TextTokenizer.from_path(missing)
    assert str(missing) in str(e.value)


def test_unsupported_paths(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelFileError, match="weights.bin"):
        TextTokenizer.from_path(tmp_path / "weights.bin")
    with pytest.raises(ModelFileError, match=str(tmp_path)):
        TextTokenizer.from_path(tmp_path)  # a directory without tokenizer.json


def test_corrupt_files(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="bad.gguf"):
        TextTokenizer.from_path(tmp_path / "bad.gguf")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        TextTokenizer.from_path(hf)


def _write_gguf(path: Path, model: str, pre: str | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_with_unsupported_model_type(tmp_path: Path) -> None:
    path = tmp_path / "rwkv.gguf"
    _write_gguf(path, "rwkv")  # RWKV's greedy trie vocabulary: not built here
    with pytest.raises(ModelFileError, match="'rwkv'") as e:
        TextTokenizer.from_path(path)
    assert str(path) in str(e.value)


def test_a_unigram_vocabulary_it_would_tokenize_differently_is_refused(tmp_path: Path) -> None:
    """A `t5` vocabulary without scores, or one whose spaces llama.cpp keeps (remove_extra_whitespaces off),
    is a load error naming what is missing, never a tokenizer that splits text otherwise than llama.cpp."""
    path = tmp_path / "no-scores.gguf"
    _write_gguf(path, "t5")
    with pytest.raises(ModelFileError, match="one score per token"):
        TextTokenizer.from_path(path)
    w = gguf.GGUFWriter(str(tmp_path / "spaces.gguf"), "bert")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<unk>", "\u2581a", "b"])
    w.add_token_scores([0.0, -1.0, -2.0])
    w.add_token_types([2, 1, 1])
    w.add_remove_extra_whitespaces(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="remove_extra_whitespaces"):
        TextTokenizer.from_path(tmp_path / "spaces.gguf")


def test_gguf_with_unsupported_pre_tokenizer(tmp_path: Path) -> None:
    """A pre-tokenizer llama.cpp names but we do not implement is refused by name (never guessed);
    tests/kvyard/test_gguf_tokenizers.py covers the supported ones."""
    path = tmp_path / "chatglm.gguf"
    _write_gguf(path, "gpt2", pre="chatglm-bpe")
    with pytest.raises(ModelFileError, match="'chatglm-bpe'"):
        TextTokenizer.from_path(path)


def test_minimal_gpt2_gguf(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "gpt2", pre="gpt-2")
    t = TextTokenizer.from_path(path)
    assert t.vocab_size == 3 and t.encode("ab") == [2]
    assert t.bos_token_id is None and t.chat_template is None and t.special_token_ids == frozenset()


def test_bounded_view_refuses_huge_text_before_tokenizing(tokenizer: TextTokenizer) -> None:
    """The frontend's view: a text that cannot fit the context whatever its tokens is refused by its
    size (context_length_exceeded), without running the tokenizer; the shared tokenizer is unchanged."""
    from kvyard.errors import ErrorCode, RequestError

    view = tokenizer.bounded(512)
    assert tokenizer.max_text_bytes is None and view.max_text_bytes is not None
    assert view.encode("Hello there") == tokenizer.encode("Hello there")

    class Exploding:
        def encode(self, *a: object, **k: object) -> object:
            raise AssertionError("tokenized a text that was too long to fit anyway")
    view._plain = view._parse = Exploding()  # type: ignore[assignment]
    huge = "word " * (view.max_text_bytes // 5 + 1)
    with pytest.raises(RequestError) as exc:
        view.encode(huge)
    assert exc.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    with pytest.raises(RequestError) as exc:
        view.encode("\ud800")
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT


def test_special_tokens_map_from_gguf_and_hf_dir(tok: TextTokenizer, hf_tok: TextTokenizer, tmp_path: Path) -> None:
    """Hugging Face's names for the special tokens, which chat templates get as variables: from the GGUF's
    metadata (its other control tokens as additional_special_tokens), from special_tokens_map.json and
    tokenizer_config.json (the config wins; tokens as strings or serialized AddedTokens)."""
    gguf_map = tok.special_tokens_map
    assert {k: gguf_map[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")} == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert "<repo_name>" in gguf_map["additional_special_tokens"]
    assert "<|im_end|>" not in gguf_map["additional_special_tokens"]  # already named
    assert hf_tok.special_tokens_map == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                         "additional_special_tokens": []}
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({
        "pad_token": "<|endoftext|>", "unk_token": {"content": "<|endoftext|>"}, "mask_token": "<file_sep>",
        "additional_special_tokens": ["<|im_start|>", {"content": "<|im_end|>", "special": True}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}))
    assert TextTokenizer.from_path(tmp_path).special_tokens_map == {
        "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "mask_token": "<file_sep>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    (tmp_path / "special_tokens_map.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match="not a JSON object"):
        TextTokenizer.from_path(tmp_path)
