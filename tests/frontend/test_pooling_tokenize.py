"""The pooling routes' tokenize step (frontend/pooling.py) with no backend: an input of megabytes past the
model's context is refused before the tokenizer sees it, with the 400 it always had; a truncated one is
tokenized only a little past what the cut keeps, and gets the ids of the whole text's tokenization. On the
tokenizers the pooling tests serve: all-MiniLM-L6-v2's WordPiece (texts and pairs), a Qwen3-Embedding-style
byte-level BPE (its post-processor appends <|endoftext|>) and Qwen3-Reranker's templated pairs."""
from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from frontend.config import FrontendConfig
from frontend.pooling import PoolingModel, PoolingPipeline
from frontend.routing import Router
from kvyard.errors import ErrorCode, RequestError
from tests.support.tiny_decoder_poolers import tiny_decoder_pooler, tiny_qwen3_reranker
from tests.support.tiny_tokenizers import sample_texts

MB8 = "word " * 1_600_000  # MAX_BODY_BYTES' worth of text: 1.6 M words, tokenized in seconds


class Spy:
    """A model's tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.encoded: list[int] = []
        self.batches: list[int] = []   # texts per encode_batch call
        self.pieces: list[int] = [0]

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.encoded.append(len(text))
        return self.tok.encode(text, *args, **kwargs)

    def encode_batch(self, texts: list[str], *args: Any, **kwargs: Any) -> Any:
        self.batches.append(len(texts))
        return self.tok.encode_batch(texts, *args, **kwargs)

    def post_process(self, *encodings: Any, **kwargs: Any) -> Any:
        self.pieces = [len(e.overflowing) for e in encodings if e is not None]  # what was cut off each side
        return self.tok.post_process(*encodings, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PoolingPipeline]]:
    tmp = tmp_path_factory.mktemp("pooling-tokenize")
    paths = {"minilm": "embedded", "qwen3-embedder": str(tiny_decoder_pooler(tmp / "embedder")),
             "qwen3-reranker": str(tiny_qwen3_reranker(tmp / "reranker"))}
    out = {}
    for name, path in paths.items():
        cfg = FrontendConfig.from_env({"MODEL_NAME": "chat", "EMBEDDING_MODEL_PATH": path})
        out[name] = PoolingPipeline(cfg, Router(cfg))
    yield out


def tokenize(pipe: PoolingPipeline, texts: list[Any], truncate: int | None = None,
             model: PoolingModel | None = None, **kw: Any) -> tuple[list[list[int]], Spy]:
    """pipe.tokenize through a spy on the model's tokenizer: the ids, and the spy."""
    model = model or pipe.model
    assert model is not None
    spy = Spy(model.tokenizer)
    spied = dataclasses.replace(model, tokenizer=spy)  # type: ignore[arg-type]
    return [i.token_ids for i in asyncio.run(pipe.tokenize(spied, texts, truncate, **kw))], spy


def refused(pipe: PoolingPipeline, texts: list[Any], **kw: Any) -> tuple[RequestError, Spy]:
    assert pipe.model is not None
    spy = Spy(pipe.model.tokenizer)
    spied = dataclasses.replace(pipe.model, tokenizer=spy)  # type: ignore[arg-type]
    with pytest.raises(RequestError) as exc:
        asyncio.run(pipe.tokenize(spied, texts, None, **kw))
    return exc.value, spy


@pytest.mark.parametrize(("name", "texts", "kw", "param", "cut_with"), [
    ("minilm", [MB8], {}, "input", "truncate_prompt_tokens"),
    ("minilm", ["short", MB8], {"prompt": "query: "}, "input", "truncate_prompt_tokens"),
    ("minilm", [("what is it?", MB8)], {"param": "documents"}, "documents", "truncate_prompt_tokens"),
    ("minilm", [(MB8, "a document")], {"param": "documents"}, "documents", "truncate_prompt_tokens"),
    ("qwen3-embedder", [MB8], {}, "input", "truncate_prompt_tokens"),
    ("qwen3-reranker", [("what is it?", MB8)], {"param": "documents", "cut_with": "truncation: true"}, "documents",
     "truncation: true"),
])
def test_megabytes_past_the_context_are_refused_before_tokenizing(pipes: dict[str, PoolingPipeline], name: str,
                                                                  texts: list[Any], kw: dict[str, Any], param: str,
                                                                  cut_with: str) -> None:
    """Each of these took seconds of a worker thread: the whole text was tokenized to count its tokens."""
    pipe = pipes[name]
    assert pipe.model is not None
    limit, i = pipe.model.spec.max_len, len(texts) - 1
    error, spy = refused(pipe, texts, **kw)
    assert error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and error.param == param
    assert error.message == (f"{param} {i} has more than {2 * limit} tokens; this model's maximum context length is "
                             f"{limit} tokens (pass {cut_with} to cut it)")
    assert max(spy.encoded, default=0) < 1000, spy.encoded  # the other input, a template's prefix and suffix


def test_an_input_a_little_too_long_keeps_its_exact_count(pipes: dict[str, PoolingPipeline]) -> None:
    """Under twice the context the whole text is tokenized, as before, and the 400 says how many tokens."""
    error, _ = refused(pipes["minilm"], ["word " * 300])
    assert error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and error.param == "input"
    assert error.message == ("input 0 has 302 tokens; this model's maximum context length is 256 tokens (pass "
                             "truncate_prompt_tokens to cut it)")
    long_pair = ("word " * 200, "word " * 200)  # 400 words, under twice the context: counted exactly
    error, _ = refused(pipes["minilm"], [long_pair], param="documents")
    assert error.message.startswith("documents 0 has 403 tokens;"), error.message


def test_only_words_count_against_the_context(pipes: dict[str, PoolingPipeline]) -> None:
    """50,000 whitespace-separated "words" of a control character are no token at all for WordPiece (its
    normalizer drops them): counting str.split() would refuse this as too long; it is [CLS] [SEP]."""
    text = "\x01 " * 50_000
    assert len(text.split()) > 2 * 256
    assert tokenize(pipes["minilm"], [text])[0] == [[101, 102]]


@pytest.mark.parametrize("name", ["minilm", "qwen3-embedder"])
def test_plain_texts_are_tokenized_in_one_batch_as_one_by_one(pipes: dict[str, PoolingPipeline], name: str) -> None:
    """Uncut single texts go through one encode_batch; each gets the ids the one-text path gives it (the
    special tokens, a prompt, the characters tokenizers treat unevenly)."""
    pipe = pipes[name]
    texts = [_long_text(seed, words) for seed, words in enumerate([1, 5, 20, 30, 10, 3])] + ["", " ", "é"]
    ids, spy = tokenize(pipe, texts, prompt="query: ")
    assert spy.batches == [len(texts)] and spy.encoded == []
    one_by_one = [tokenize(pipe, [text, ("a", "b")], prompt="query: ")[0][0] for text in texts]  # a pair: per text
    assert ids == one_by_one
    assert pipe.model is not None
    limit = pipe.model.spec.max_len
    error, spy = refused(pipe, ["short", "word " * (limit + limit // 2), MB8])  # MB8: too long by its words alone
    assert error.message.startswith("input 1 has ") and "more than" not in error.message, error.message  # counted
    assert spy.batches == [2] and spy.encoded == []


def _long_text(seed: int, words: int) -> str:
    """Prose, code and several scripts, with the characters tokenizers treat unevenly."""
    rng = random.Random(seed)
    odd = ["\x01", "\u0301", "\x1c", "\ufffd", "\u200b", "\t", "\n", "\r\n", "  ", "\xa0", "\u3000", "中文", "。",
           "😀", "<|endoftext|>", "[SEP]", "don't", "e\u0301"]
    parts: list[str] = []
    while len(parts) < words:
        parts += sample_texts(1, rng.randrange(10**6))[0].split(" ")
        parts.append(rng.choice(odd) + rng.choice(odd))
    return " ".join(parts[:words])


# Two sides both far past the cut: with an even room (201 - 3 specials) half each whichever is the longer; with an
# odd one the longer side takes the odd token, so the shorter is tokenized to its end to know which
# (test_pairs_are_cut_as_the_tokenizers_library_cuts_them).
CUTS = [
    ("minilm", "single", -1), ("minilm", "single", 9), ("minilm", "pair-long-short", -1),
    ("minilm", "pair-short-long", 40), ("minilm", "pair-long-long", 201), ("minilm", "prompt", -1),
    ("qwen3-embedder", "single", -1), ("qwen3-embedder", "single", 3),
    ("qwen3-reranker", "pair-short-long", -1), ("qwen3-reranker", "pair-long-long", 300),
]


@pytest.mark.parametrize(("name", "shape", "truncate"), CUTS)
def test_a_truncated_text_is_tokenized_only_past_the_cut_with_the_whole_texts_ids(
        pipes: dict[str, PoolingPipeline], name: str, shape: str, truncate: int) -> None:
    pipe = pipes[name]
    assert pipe.model is not None
    for seed in range(3):
        long, other = _long_text(seed, 6000), _long_text(seed + 100, 12)
        texts: list[Any] = {"single": [long], "prompt": [long], "pair-long-short": [(long, other)],
                            "pair-short-long": [(other, long)],
                            "pair-long-long": [(long, _long_text(seed + 200, 5000))]}[shape]
        kw = {"prompt": "query: "} if shape == "prompt" else {}
        ids, spy = tokenize(pipe, texts, truncate, **kw)
        assert max(spy.encoded) < len(long) // 4, spy.encoded  # not the whole text: a little past the cut
        whole, spy = tokenize(pipe, texts, truncate, model=dataclasses.replace(pipe.model, bounded=False), **kw)
        assert max(spy.encoded) >= len(long)  # the reference: the whole text tokenized, then cut
        assert ids == whole
        assert len(ids[0]) == (pipe.model.spec.max_len if truncate == -1 else truncate)


def test_megabytes_truncated_are_tokenized_only_past_the_cut(pipes: dict[str, PoolingPipeline]) -> None:
    for name, texts in (("minilm", [MB8]), ("minilm", [("what is it?", MB8)]), ("qwen3-reranker", [("q", MB8)])):
        ids, spy = tokenize(pipes[name], texts, -1)
        assert max(spy.encoded) < 10_000 and len(ids[0]) == pipes[name].model.spec.max_len  # type: ignore[union-attr]


def test_pairs_are_cut_as_the_tokenizers_library_cuts_them(pipes: dict[str, PoolingPipeline]) -> None:
    """Longest-first truncation of a (query, document) pair gives the ids of the tokenizers library's own
    (what sentence-transformers' CrossEncoder runs through transformers' fast tokenizer): the shorter side
    whole when it fits in half the room, else half each with an odd token to the longer side, to the second
    on a tie; through the bounded cut too, where both sides are far past the room."""
    pipe = pipes["minilm"]
    assert pipe.model is not None
    ref = Tokenizer.from_str(pipe.model.tokenizer.to_str())
    rng = random.Random(7)
    words = "the cat sat on a mat while old dogs ran far from home into bright green fields".split()  # a token each
    cases = [(rng.randrange(1, 40), rng.randrange(1, 40), rng.randrange(6, 40)) for _ in range(150)]
    cases += [(n, n, t) for n, t in ((20, 17), (20, 18), (9, 12), (30, 9))]  # ties, odd and even rooms
    cases += [(3000, 2000, 201), (2000, 3000, 201), (2500, 2500, 201), (3000, 2000, 200)]  # both far past
    for la, lb, truncate in cases:
        a, b = (" ".join(rng.choice(words) for _ in range(n)) for n in (la, lb))
        ids, spy = tokenize(pipe, [(a, b)], truncate, param="documents")
        ref.enable_truncation(max_length=truncate, strategy="longest_first")
        assert ids[0] == ref.encode(a, b).ids, (la, lb, truncate)
        assert max(spy.pieces) <= 2, (la, lb, truncate)  # not every pair of 100-token pieces (seconds)
