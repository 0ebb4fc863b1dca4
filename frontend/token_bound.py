"""Before the pooling pipeline tokenizes (frontend/pooling.py): how many tokens a text has at least, read from
its words without tokenizing it, and where a text may be cut so that what is kept tokenizes to the whole
text's first tokens. A body of megabytes then costs a scan, not seconds of the frontend's worker threads.

A word here is a run of characters between ASCII spaces that holds an ASCII letter or digit; each is at least
one token of its own. Not every whitespace-separated run is: WordPiece's normalizer drops control characters,
U+FFFD, zero-width spaces and (lowercasing) combining marks, so "\\x01" is no token, and it joins "a\\x1cb"
(two words to str.split()) into one; SentencePiece pieces may hold a tab or newline. ASCII letters and digits
survive every normalizer the served families use (lowercasing, NFC/NFKC, accent stripping), and no token
spans an ASCII space between two words when no piece of the vocabulary holds a space after something else:
words_are_tokens checks that once per model (WordPiece, byte-level BPE and SentencePiece vocabularies pass).
tests/frontend/test_token_bound.py checks both properties on each family's tokenizer."""
from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from tokenizers import Tokenizer

# Anchored after a space and possessive, so a long run without a letter or digit is scanned once.
_WORD = re.compile(r"(?<![^ ])[^ A-Za-z0-9]*+[A-Za-z0-9][^ ]*+")
_CUT = re.compile(r"(?<=\S) ")      # a space after a character that is not whitespace
_BRIDGE = re.compile(r"[^ ] ")      # a piece with a space after something else
_PROBE = " ".join("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


def words_are_tokens(tok: Tokenizer) -> bool:
    """Whether more_words and cut_after hold for this tokenizer: its pieces (added tokens too) read as text
    hold no space after anything but whitespace, and a letter or digit between spaces is at least a token."""
    if tok.decoder is None:  # the pieces' text cannot be read
        return False
    pieces = tok.decode_batch([[i] for i in range(tok.get_vocab_size(with_added_tokens=True))],
                              skip_special_tokens=False)
    if any(_BRIDGE.search(p) and not p.isspace() for p in pieces):
        return False
    return len(tok.encode(_PROBE, add_special_tokens=False).ids) >= len(_PROBE.split(" "))


def more_words(texts: Sequence[str], n: int) -> bool:
    """Whether the texts hold more than n words together, so more than n tokens (counts no further)."""
    left = n + 1
    for text in texts:
        if left <= 0:
            break
        left -= sum(1 for _ in itertools.islice(_WORD.finditer(text), left))
    return left <= 0


def cut_after(text: str, words: int) -> str:
    """The start of `text` that holds at least `words` words (so as many tokens), ended before a space that
    follows a character that is not whitespace: every pre-tokenizer splits there and no piece spans it, so its
    tokens are the whole text's first ones. The text itself when it has no such place past that many words."""
    last = next(itertools.islice(_WORD.finditer(text), max(words, 1) - 1, None), None)
    return text if last is None else cut_at(text, last.end())


def cut_at(text: str, end: int) -> str:
    """The start of `text` up to the first place at or after character `end` where cut_after may cut (before a
    space that follows a character that is not whitespace): its tokens are the whole text's first ones."""
    cut = _CUT.search(text, end)
    return text if cut is None else text[:cut.start()]
