"""frontend/token_bound.py's two claims on each tokenizer family the tests serve or build (all-MiniLM-L6-v2's
WordPiece; byte-level BPE split as GPT-2, SmolLM, Llama 3, Qwen2 and Mistral Nemo split; a Llama 2-style
SentencePiece BPE), over random text full of what tokenizers treat unevenly: a text has at least as many
tokens as words, and a text cut where cut_after cuts tokenizes to the whole text's first tokens."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from frontend.token_bound import cut_after, more_words, words_are_tokens
from kvyard.pooling_model import embedded_embedding_path
from tests.support.tiny_tokenizers import QWEN2_SPECIALS, byte_level_tokenizer, sentencepiece_tokenizer

PIECES = ["a", "b", "Z", "7", "42", "word", "Ab3", "don't", "'s", "ab!", "x.y", "é", "e\u0301", "\u0301",
          "\x00", "\x01", "\x1c", "\ufffd", "\u200b", "中文", "中", "。", "!", ".", "😀", " ", " ", "  ", "\t",
          "\n", "\r\n", "\xa0", "\u3000", "\u2028", "<|endoftext|>", "[SEP]", "##", "\u2581", "\u0120"]


def _minilm() -> Tokenizer:
    tok = Tokenizer.from_file(str(embedded_embedding_path() / "tokenizer.json"))
    tok.no_padding()  # its tokenizer.json pads to 128
    tok.no_truncation()
    return tok


FAMILIES = {"wordpiece": _minilm, "sentencepiece": lambda: sentencepiece_tokenizer().reference,
            **{f"byte-level-{pre}": (lambda pre=pre: byte_level_tokenizer(pre, specials=QWEN2_SPECIALS).reference)
               for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2", "tekken")}}


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_words_are_tokens_and_a_cut_keeps_the_first_tokens(family: str) -> None:
    tok = FAMILIES[family]()
    assert words_are_tokens(tok)
    rng = random.Random(family)
    cuts = 0
    for _ in range(1500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
        ids = _ids(tok, text)
        assert not more_words([text], len(ids)), (text, ids)
        for words in range(1, 12):
            kept = cut_after(text, words)
            if kept == text:
                break
            cuts += 1
            assert text[len(kept)] == " " and not kept[-1].isspace() and more_words([kept], words - 1)
            first = _ids(tok, kept)
            assert ids[:len(first)] == first, (text, len(kept))
    assert cuts > 1000


def test_whitespace_separated_runs_are_not_all_tokens() -> None:
    """Why a word must hold an ASCII letter or digit, split at ASCII spaces only: WordPiece drops control
    characters (and joins what they separated), U+FFFD, zero-width spaces, lone combining marks."""
    tok = _minilm()
    for text, tokens, words in (("\x01 \x01", 0, 0), ("\ufffd \u200b \u0301", 0, 0), ("a\x1cb", 1, 1),
                                ("a\x1cb\x1cc", 1, 1), ("\x01\x02 a", 1, 1)):
        assert len(_ids(tok, text)) == tokens < len(text.split())
        assert more_words([text], words - 1) and not more_words([text], words)


def test_more_words_counts_across_texts_and_stops_early() -> None:
    assert more_words(["a b", "c"], 2) and not more_words(["a b", "c"], 3)
    assert more_words(["x"], -1) and not more_words([""], 0)
    assert more_words(["w " * 1_000_000], 10)  # counts 11, not a million


def test_cut_after_leaves_a_text_it_cannot_cut() -> None:
    assert cut_after("one two three", 2) == "one two"
    assert cut_after("one two three", 3) == "one two three"
    assert cut_after("one\n two three", 1) == "one\n two"  # not after whitespace: the pieces there differ
    assert cut_after("a" * 100, 1) == "a" * 100


def test_a_vocabulary_with_a_piece_across_a_space_is_not_bounded() -> None:
    spanning = byte_level_tokenizer("qwen2").reference
    spanning.add_tokens([AddedToken("New York", normalized=False)])
    assert len(_ids(spanning, "New York")) == 1  # two words, one token: the bound would be wrong
    assert not words_are_tokens(spanning)
    blind = byte_level_tokenizer("qwen2").reference
    blind.decoder = None  # its pieces cannot be read as text
    assert not words_are_tokens(blind)
