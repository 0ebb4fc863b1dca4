"""Text ⇄ token ids for the frontend (prompt → ids) and the detokenizer (ids → streamed text)."""
from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvyard.errors import ErrorCode, RequestError
from kvyard.gguf_meta import read_gguf_metadata
from kvyard.model_path import ModelFileError, is_gguf

log = logging.getLogger("kvyard.tokenizer")

GGUF_TOKEN_TYPE_CONTROL = 3

# llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`) whose split is "each digit alone, then the GPT-2
# regex" — what Digits(individual_digits=True) + ByteLevel(use_regex=True) reproduce exactly.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_GPT2_PRE = frozenset({"gpt-2"})


class TextTokenizer:
    """A byte-level BPE tokenizer built from a GGUF file or a Hugging Face tokenizer.json.

    Safe to share between threads: nothing is mutated after construction.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_templates: dict[str, str],
        add_bos_token: bool,
        special_token_ids: frozenset[int],
    ) -> None:
        # `encode_special_tokens` is a property of the Rust object, so toggling it per call would race
        # between threads; keep one instance per mode instead.
        self._parse = tokenizer
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_text_bytes: int | None = None  # see bounded()
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.bos_token: str | None = None if bos_token_id is None else tokenizer.id_to_token(bos_token_id)
        self.eos_token: str | None = None if eos_token_id is None else tokenizer.id_to_token(eos_token_id)
        self.chat_templates: dict[str, str] = dict(chat_templates)
        self.chat_template: str | None = chat_templates.get("default")
        self.add_bos_token = add_bos_token
        self.special_token_ids = special_token_ids

    @classmethod
    def from_path(cls, path: str | Path) -> TextTokenizer:
        """Load from a .gguf file or a Hugging Face directory holding tokenizer.json."""
        p = Path(path).expanduser()
        start = time.perf_counter()
        if is_gguf(p):
            tok = cls._from_gguf(p)
        elif p.is_dir() and (p / "tokenizer.json").is_file():
            tok = cls._from_hf_dir(p)
        elif not p.exists():
            raise ModelFileError(f"tokenizer path does not exist: {p}")
        else:
            raise ModelFileError(f"not a .gguf file or a directory with tokenizer.json: {p}")
        log.info("loaded tokenizer from %s: vocab %d in %.2fs", p, tok.vocab_size, time.perf_counter() - start)
        return tok

    @classmethod
    def _from_gguf(cls, path: Path) -> TextTokenizer:
        try:
            meta = read_gguf_metadata(path)
        except Exception as e:  # gguf raises assorted errors on a truncated or foreign file
            raise ModelFileError(f"cannot read GGUF metadata from {path}: {e}") from e
        model_type = meta.get("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise ModelFileError(
                f"unsupported GGUF tokenizer model {model_type!r} in {path}: only 'gpt2' (byte-level BPE) is supported"
            )
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        if pre in _DIGIT_SPLIT_PRE:
            splitters: list[Any] = [pre_tokenizers.Digits(individual_digits=True)]
        elif pre in _GPT2_PRE:
            splitters = []
        else:
            # Other llama.cpp pre-tokenizers use different regexes; guessing would give silently wrong ids.
            raise ModelFileError(f"unsupported GGUF pre-tokenizer {pre!r} in {path}")
        try:
            tokens: list[str] = meta["tokenizer.ggml.tokens"]
            merges_raw: list[str] = meta["tokenizer.ggml.merges"]
        except KeyError as e:
            raise ModelFileError(f"GGUF file {path} has no {e.args[0]} field") from e
        token_types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))

        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [*splitters, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
        tokenizer.decoder = decoders.ByteLevel()
        control = [i for i, t in enumerate(token_types) if t == GGUF_TOKEN_TYPE_CONTROL]
        # The ids already exist in the vocab, so adding them keeps their ids; normalized=False matches them
        # verbatim in the raw text.
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])

        templates: dict[str, str] = {}
        if isinstance(meta.get("tokenizer.chat_template"), str):
            templates["default"] = meta["tokenizer.chat_template"]
        for name in meta.get("tokenizer.chat_templates", []) or []:
            named = meta.get(f"tokenizer.chat_template.{name}")
            if isinstance(named, str):
                templates[name] = named
        return cls(
            tokenizer,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            chat_templates=templates,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            special_token_ids=frozenset(control),
        )

    @classmethod
    def _from_hf_dir(cls, path: Path) -> TextTokenizer:
        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelFileError(f"cannot load {path / 'tokenizer.json'}: {e}") from e
        config: dict[str, Any] = {}
        config_path = path / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ModelFileError(f"cannot read {config_path}: {e}") from e

        templates = _hf_chat_templates(config.get("chat_template"))
        # Newer transformers save the template beside the config instead of inside it.
        jinja_path = path / "chat_template.jinja"
        if "default" not in templates and jinja_path.is_file():
            templates["default"] = jinja_path.read_text(encoding="utf-8")

        bos_id = _hf_token_id(tokenizer, config.get("bos_token"))
        eos_id = _hf_token_id(tokenizer, config.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Without the flag, the post-processor decides (e.g. Llama 3 adds BOS only there).
            first = tokenizer.encode("", add_special_tokens=True).ids[:1]
            add_bos = bos_id is not None and first == [bos_id]
        specials = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        return cls(
            tokenizer,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            chat_templates=templates,
            add_bos_token=bool(add_bos),
            special_token_ids=specials,
        )

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        """Token ids for `text`; BOS is never added here (the caller decides, see add_bos_token).

        parse_special=False treats control-token strings such as `<|im_end|>` as plain text, so user
        content cannot forge them; True is for rendered chat templates.
        """
        tok = self._parse if parse_special else self._plain
        return tok.encode(self._encodable(text), add_special_tokens=False).ids

    def bounded(self, max_tokens: int) -> TextTokenizer:
        """A view that refuses, before tokenizing, any text too long to fit max_tokens tokens however
        it splits (its UTF-8 size over the vocabulary's longest piece): a body of megabytes costs a
        length check, not seconds of tokenizing on the event loop and a gigabyte of pieces."""
        view = copy.copy(self)
        longest = max(len(piece) for piece in self._parse.get_vocab(with_added_tokens=True))
        view.max_text_bytes = max_tokens * max(longest, 1)
        return view

    def _encodable(self, text: str) -> str:
        """JSON may carry a lone UTF-16 surrogate (\\ud800): valid JSON, not text. The client's 400."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"the text has a lone UTF-16 surrogate at character {exc.start}: not valid Unicode") from None
        if self.max_text_bytes is not None and size > self.max_text_bytes:
            raise RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                               f"the text is {size} bytes: more than this model's context can hold "
                               f"whatever its tokens (at most {self.max_text_bytes} bytes)")
        return text

    def encode_with_offsets(
        self, text: str, parse_special: bool = False
    ) -> tuple[list[int], list[str], list[tuple[int, int]]]:
        """Ids, their pieces (vocab strings, byte-level encoded) and (start, end) character offsets."""
        tok = self._parse if parse_special else self._plain
        enc = tok.encode(self._encodable(text), add_special_tokens=False)
        return enc.ids, enc.tokens, [(s, e) for s, e in enc.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; incomplete UTF-8 byte sequences come out as U+FFFD."""
        ids = [int(i) for i in ids]  # accepts numpy / torch integers too
        self.check_ids(ids)
        return self._parse.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raise ValueError if any id is outside the vocabulary (tokenizers would drop it silently)."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:8]}")

    def id_to_piece(self, token_id: int) -> str:
        """The vocab string of one id, e.g. 'Ġworld' (byte-level encoded, not decoded text)."""
        token_id = int(token_id)
        self.check_ids([token_id])
        piece = self._parse.id_to_token(token_id)
        if piece is None:  # a hole in a sparse vocabulary
            raise ValueError(f"token id {token_id} has no piece")
        return piece

    def to_json(self) -> str:
        """tokenizer.json's text (what grammar libraries such as llguidance build their token tables from)."""
        return self._parse.to_str()

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json, e.g. to turn a GGUF's tokenizer into a Hugging Face tokenizer dir."""
        self._parse.save(str(path))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _hf_chat_templates(raw: Any) -> dict[str, str]:
    """tokenizer_config.json's chat_template: one string, or a list of {"name", "template"}."""
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {
            str(item["name"]): str(item["template"])
            for item in raw
            if isinstance(item, dict) and "name" in item and "template" in item
        }
    return {}


def _hf_token_id(tokenizer: Tokenizer, token: Any) -> int | None:
    """tokenizer_config.json writes special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return tokenizer.token_to_id(token)

