"""GGUF tokenizers of each family against the tokenizer they were made from: a vocabulary trained here
per llama.cpp pre-tokenizer (split by the regexes transformers ships for those families), exported to
GGUF metadata as llama.cpp's converter does, rebuilt by kvyard from that metadata alone, and compared
on a few hundred strings (digits, CJK, emoji, code, whitespace runs, contractions, combining accents); the
SentencePiece kind with and without the "▁" in front of the text (Llama 2's; Gemma's, `add_space_prefix` false)."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvyard.model_path import ModelFileError
from kvyard.tokenizer import TextTokenizer
from tests.support.tiny_tokenizers import (LLAMA3_SPECIALS, QWEN2_SPECIALS, TokenizerSpec, add_gguf_tokenizer,
                                       byte_level_tokenizer, sample_texts, sentencepiece_tokenizer)

STRINGS = sample_texts(300, seed=7) + ["", " ", "  leading", "x  ", "\n", "1234567", "a\u0301", "ＡＢＣ"]


def write_tokenizer_gguf(spec: TokenizerSpec, path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    add_gguf_tokenizer(w, spec)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_ids(spec: TokenizerSpec, text: str) -> list[int]:
    enc = spec.reference.encode(text, add_special_tokens=False)
    return enc if isinstance(enc, list) else enc.ids


@pytest.fixture(scope="module", params=["gpt-2", "smollm", "llama-bpe", "qwen2", "tekken", "spm", "spm-no-prefix"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenizerSpec, TextTokenizer]:
    pre = request.param
    if pre.startswith("spm"):  # spm-no-prefix: Gemma's kind (add_space_prefix false)
        spec = sentencepiece_tokenizer(extra_specials=("[INST]", "[/INST]"), space_prefix=pre == "spm")
    else:
        specials = {"llama-bpe": LLAMA3_SPECIALS, "qwen2": QWEN2_SPECIALS}.get(pre, ("<|endoftext|>",))
        spec = byte_level_tokenizer(pre, specials=specials,
                                    user_defined=("<tool_call>", "</tool_call>") if pre == "qwen2" else ())
    path = write_tokenizer_gguf(spec, tmp_path_factory.mktemp(pre.replace("-", "_")) / "tok.gguf")
    assert gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.add_space_prefix") is not None or not pre.startswith("spm")
    return spec, TextTokenizer.from_path(path)


def test_ids_equal_the_reference(pair: tuple[TokenizerSpec, TextTokenizer]) -> None:
    spec, ours = pair
    mismatches = [(text, ours.encode(text), reference_ids(spec, text)) for text in STRINGS
                  if ours.encode(text) != reference_ids(spec, text)]
    assert not mismatches, f"{spec.pre}: {len(mismatches)}/{len(STRINGS)} differ, first: {mismatches[0]!r}"
    # Not vacuous: the vocabulary merges (most strings take fewer tokens than bytes).
    assert sum(len(ours.encode(t)) for t in STRINGS) < 0.7 * sum(len(t.encode()) for t in STRINGS)


def test_text_round_trips(pair: tuple[TokenizerSpec, TextTokenizer]) -> None:
    spec, ours = pair
    for text in STRINGS:
        assert ours.decode(ours.encode(text)) == (text if spec.pre != "qwen2" else _nfc(text)), text


def test_special_and_user_defined_tokens(pair: tuple[TokenizerSpec, TextTokenizer]) -> None:
    spec, ours = pair
    control = [t for t, k in zip(spec.tokens, spec.token_types) if k == 3]
    for token in control:
        assert spec.id(token) in ours.encode(f"a{token}b", parse_special=True)  # a rendered template's
        assert spec.id(token) not in ours.encode(f"a{token}b")  # typed by a user: plain text
    for token in [t for t, k in zip(spec.tokens, spec.token_types) if k == 4]:
        assert spec.id(token) in ours.encode(f"x {token} y")  # user-defined: whole, even in user text


def _nfc(text: str) -> str:
    import unicodedata
    return unicodedata.normalize("NFC", text)


def test_family_defaults(tmp_path: Path) -> None:
    """llama.cpp's defaults when a file carries no add_bos_token flag: BOS for Llama 3 and SentencePiece
    vocabularies, none for GPT-2-style ones; eot/eom ids stop generation beside eos."""
    spec = byte_level_tokenizer("llama-bpe", specials=LLAMA3_SPECIALS)
    spec.specials = {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "eot": "<|eot_id|>", "eom": "<|eom_id|>"}
    llama3 = TextTokenizer.from_path(write_tokenizer_gguf(spec, tmp_path / "l3.gguf"))
    assert llama3.add_bos_token and llama3.bos_token_id == spec.id("<|begin_of_text|>")
    assert llama3.stop_token_ids == {spec.id(t) for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")}
    spm = TextTokenizer.from_path(write_tokenizer_gguf(sentencepiece_tokenizer(), tmp_path / "spm.gguf"))
    assert spm.add_bos_token and spm.bos_token_id == 1 and spm.stop_token_ids == {2}
    gpt2 = TextTokenizer.from_path(write_tokenizer_gguf(byte_level_tokenizer("gpt-2"), tmp_path / "g.gguf"))
    assert not gpt2.add_bos_token


def test_unknown_pre_tokenizer_names_itself(tmp_path: Path) -> None:
    spec = byte_level_tokenizer("gpt-2")
    spec.pre = "viking"
    with pytest.raises(ModelFileError, match="'viking'.*supported: .*llama-bpe.*qwen2"):
        TextTokenizer.from_path(write_tokenizer_gguf(spec, tmp_path / "v.gguf"))
