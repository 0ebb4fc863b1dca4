"""A GGUF file's vocabulary as a `tokenizers` Tokenizer: byte-level BPE with each llama.cpp pre-tokenizer
(`tokenizer.ggml.pre`), a SentencePiece ('llama') vocabulary rebuilt as BPE with byte fallback, a BERT
WordPiece ('bert') vocabulary, or a SentencePiece Unigram ('t5': XLM-RoBERTa's, BGE-M3's) one.
kvyard/tokenizer.py adds the special tokens, stop ids and chat templates."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvyard.gguf_meta import read_gguf_metadata
from kvyard.model_path import ModelFileError

# llama.cpp's token types (tokenizer.ggml.token_type).
GGUF_TOKEN_NORMAL, GGUF_TOKEN_UNKNOWN, GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED, GGUF_TOKEN_UNUSED, GGUF_TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6)
GGUF_TOKEN_TYPE_CONTROL = GGUF_TOKEN_CONTROL

# How each model family splits text before byte-level BPE, by llama.cpp's pre-tokenizer name
# (`tokenizer.ggml.pre`). The regexes are the ones in those models' own tokenizer.json files.
_GPT2_SPLIT = None  # ByteLevel's built-in GPT-2 regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    split: str | None           # the regex pieces are cut by; None: GPT-2's
    digits: bool = False        # each digit its own piece first (SmolLM2, StarCoder)
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is taken as is (Llama 3)
    nfc: bool = False           # NFC-normalize the text first (Qwen2's tokenizer.json does)
    add_bos: bool = False       # llama.cpp's default when the file has no add_bos_token flag


PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais", "modern-bert"), _PreTokenizer(_GPT2_SPLIT)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    _PreTokenizer(_GPT2_SPLIT, digits=True)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3"),
                    _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)),
    **dict.fromkeys(("smaug-bpe", "dbrx"), _PreTokenizer(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "megrez", "deepseek-r1-qwen", "stablelm2"), _PreTokenizer(_QWEN2_SPLIT, nfc=True)),
    "tekken": _PreTokenizer(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(PRE_TOKENIZERS))


def gguf_metadata(path: Path) -> dict[str, Any]:
    try:
        return read_gguf_metadata(path)
    except Exception as e:  # gguf raises assorted errors on a truncated or foreign file
        raise ModelFileError(f"cannot read GGUF metadata from {path}: {e}") from e


def unsupported_model(model_type: Any, path: Path) -> str:
    return (f"unsupported GGUF tokenizer model {model_type!r} in {path}: 'gpt2' (byte-level BPE), 'llama' "
            "(SentencePiece BPE), 'bert' (WordPiece) and 't5' (SentencePiece Unigram) are supported")


def unsupported_pre(pre_name: Any, path: Path) -> str:
    return f"unsupported GGUF pre-tokenizer {pre_name!r} in {path} (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"


def opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def byte_level_bpe(path: Path, meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, bool]:
    """tokenizer.ggml.model "gpt2": byte-level BPE over the vocabulary and merges, after the family's
    pre-tokenizer split. Returns the tokenizer and llama.cpp's add-BOS default for this family."""
    pre_name = meta.get("tokenizer.ggml.pre", "gpt-2")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        # Other pre-tokenizers use other regexes; guessing would give silently wrong ids.
        raise ModelFileError(unsupported_pre(pre_name, path))
    try:
        merges_raw: list[str] = meta["tokenizer.ggml.merges"]
    except KeyError as e:
        raise ModelFileError(f"GGUF file {path} has no {e.args[0]} field") from e
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=pre.ignore_merges))
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []
    if pre.split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if pre.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre.add_bos


def sentencepiece_bpe(path: Path, meta: dict[str, Any], tokens: list[str],
                            token_types: list[int]) -> tuple[Tokenizer, bool]:
    """tokenizer.ggml.model "llama" (Llama 1/2, Mistral v0.1-v0.3): SentencePiece BPE. Spaces are "▁",
    one is put in front of the text, pieces merge best score first, and a character outside the
    vocabulary falls back to its UTF-8 bytes (<0xNN> tokens). The merges are the vocabulary's own: every
    split of a piece into two pieces, ranked by the piece's score."""
    scores: list[float] = meta.get("tokenizer.ggml.scores") or []
    if len(scores) != len(tokens):
        raise ModelFileError(f"GGUF file {path}: a SentencePiece vocabulary needs one score per token")
    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise ModelFileError(f"GGUF file {path}: remove_extra_whitespaces is not supported")
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, kind in zip(tokens, token_types) if kind == GGUF_TOKEN_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece in mergeable:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[vocab[piece]], vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = next((tokens[i] for i, kind in enumerate(token_types) if kind == GGUF_TOKEN_UNKNOWN), None)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(r[3], r[4]) for r in ranked], unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    # As sentencepiece and llama.cpp do (and Llama 2's tokenizer.json): a space in front of every stretch of
    # text, the first and each after a special token ([INST] hi → ▁[INST]... ▁▁hi), even one that starts
    # with a space; then every space is ▁.
    prefix = [normalizers.Prepend("\u2581")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *([decoders.Strip(" ", 1, 0)]
                                             if meta.get("tokenizer.ggml.add_space_prefix", True) else [])])
    return tokenizer, True


def wordpiece(path: Path, meta: dict[str, Any], tokens: list[str], token_types: list[int]) -> tuple[Tokenizer, bool]:
    """tokenizer.ggml.model "bert": WordPiece, its vocabulary as llama.cpp's converter spells it turned back into
    BERT's: a word's first piece carries a leading "▁" there and none here, a continuation none there and "##"
    here, control tokens ([CLS], [SEP]; older files: every "[...]" token) as they are. Text is normalised as
    llama.cpp's WordPiece tokenizer does it (control characters dropped, CJK characters split apart, NFD with
    the accents dropped, lowercase), then split on whitespace and punctuation; a word longer than 100
    characters, or one the pieces cannot spell, is the unknown token. Returns llama.cpp's add-[CLS] default."""
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind == GGUF_TOKEN_CONTROL or (token.startswith("[") and token.endswith("]")):
            piece = token
        elif token.startswith("\u2581"):
            piece = token[1:]
        else:
            piece = "##" + token
        vocab.setdefault(piece, i)
    unk = next((tokens[i] for i, kind in enumerate(token_types) if kind == GGUF_TOKEN_UNKNOWN), None)
    unk = unk if unk is not None else ("[UNK]" if "[UNK]" in vocab else None)
    if unk is None:
        raise ModelFileError(f"GGUF file {path}: a WordPiece vocabulary needs an unknown token ([UNK])")
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk, max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                                      lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer, True


def unigram(path: Path, meta: dict[str, Any], tokens: list[str], token_types: list[int]) -> tuple[Tokenizer, bool]:
    """tokenizer.ggml.model "t5": a SentencePiece Unigram vocabulary (XLM-RoBERTa's, hence BGE-M3's and
    bge-reranker's, as llama.cpp's converter writes it), tokenized as SentencePiece and llama.cpp do it: the
    text through the file's precompiled normalization map (NFKC and friends), spaces trimmed and collapsed,
    "▁" before every word, then the most probable split by the pieces' scores, a character no piece spells
    being the unknown token (consecutive ones fused). Unused entries (the converter's padding, score -10000)
    keep their ids at the lowest normal score, so the unknown token's score (lowest - 10) stays
    SentencePiece's. Returns llama.cpp's add-BOS default for the model (no; XLM-R's files say yes)."""
    scores: list[float] = meta.get("tokenizer.ggml.scores") or []
    if len(scores) != len(tokens):
        raise ModelFileError(f"GGUF file {path}: a SentencePiece vocabulary needs one score per token")
    if not meta.get("tokenizer.ggml.remove_extra_whitespaces", False):
        # Without it llama.cpp keeps every space as its own "▁" and prefixes the first word only; no pooling
        # model we know of is converted that way, so it is refused rather than tokenized differently.
        raise ModelFileError(f"GGUF file {path}: a Unigram vocabulary without remove_extra_whitespaces is not supported")
    unk = next((i for i, kind in enumerate(token_types) if kind == GGUF_TOKEN_UNKNOWN),
               opt_int(meta.get("tokenizer.ggml.unknown_token_id")))
    if unk is None:
        raise ModelFileError(f"GGUF file {path}: a Unigram vocabulary needs an unknown token")
    normal = [s for s, kind in zip(scores, token_types) if kind == GGUF_TOKEN_NORMAL]
    lowest = min(normal, default=0.0)
    pieces = [(t, float(s) if kind != GGUF_TOKEN_UNUSED else lowest)
              for t, s, kind in zip(tokens, scores, token_types)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=unk, byte_fallback=False))
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        tokenizer.normalizer = normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap))
    # Only " " is a space to SentencePiece and llama.cpp (the map turns tabs, newlines and wide spaces into it).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="removed"),
                                                       pre_tokenizers.Metaspace("\u2581", prepend_scheme="always")])
    tokenizer.decoder = decoders.Metaspace("\u2581", prepend_scheme="always")
    return tokenizer, False
