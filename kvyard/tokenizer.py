"""Text ⇄ token ids for the frontend (prompt → ids) and the detokenizer (ids → streamed text)."""
from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, processors

from kvyard.errors import ErrorCode, RequestError
from kvyard import gguf_vocab, special_tokens
from kvyard.model_path import ModelFileError, is_gguf
from kvyard.st_files import static_embedding

log = logging.getLogger("kvyard.tokenizer")

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
        stop_token_ids: frozenset[int] = frozenset(),
        special_tokens_map: dict[str, Any] | None = None,
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
        # Hugging Face's names → token text (kvyard/special_tokens.py); chat templates get each as a variable.
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        self.special_tokens_map: dict[str, Any] = {**{k: v for k, v in named.items() if v is not None},
                                                   **(special_tokens_map or {})}
        self.chat_templates: dict[str, str] = dict(chat_templates)
        self.chat_template: str | None = chat_templates.get("default")
        self.add_bos_token = add_bos_token
        self.special_token_ids = special_token_ids
        # SentencePiece-style pieces ('▁word', '<0xE4>') rather than byte-level ones ('Ġword').
        self._spm = isinstance(tokenizer.model, models.BPE) and bool(tokenizer.model.byte_fallback)
        # Ids that end generation: eos, plus the model's end-of-turn ids (Llama 3's <|eot_id|>, <|eom_id|>;
        # a Hugging Face directory's generation_config.json eos_token_id list).
        self.stop_token_ids: frozenset[int] = stop_token_ids | frozenset(
            i for i in (eos_token_id,) if i is not None)

    @classmethod
    def from_path(cls, path: str | Path) -> TextTokenizer:
        """Load from a .gguf file or a Hugging Face directory holding tokenizer.json (a StaticEmbedding model's: in
        its module's folder)."""
        p = Path(path).expanduser()
        p = static_embedding(p) or p
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

    @staticmethod
    def check_path(path: str | Path) -> None:
        """What from_path would refuse, found without building the tokenizer (the launcher's one-line
        error for a GGUF of an unknown tokenizer model or pre-tokenizer, or a directory without one)."""
        p = Path(path).expanduser()
        p = static_embedding(p) or p
        if not is_gguf(p):
            if not (p.is_dir() and (p / "tokenizer.json").is_file()):
                raise ModelFileError(f"not a .gguf file or a directory with tokenizer.json: {p}")
            return
        meta = gguf_vocab.gguf_metadata(p)
        model_type = meta.get("tokenizer.ggml.model")
        if model_type not in ("gpt2", "llama", "bert", "t5"):
            raise ModelFileError(gguf_vocab.unsupported_model(model_type, p))
        pre_name = meta.get("tokenizer.ggml.pre", "gpt-2")
        if model_type == "gpt2" and pre_name not in gguf_vocab.PRE_TOKENIZERS:
            raise ModelFileError(gguf_vocab.unsupported_pre(pre_name, p))

    @classmethod
    def _from_gguf(cls, path: Path) -> TextTokenizer:
        meta = gguf_vocab.gguf_metadata(path)
        model_type = meta.get("tokenizer.ggml.model")
        try:
            tokens: list[str] = meta["tokenizer.ggml.tokens"]
        except KeyError as e:
            raise ModelFileError(f"GGUF file {path} has no {e.args[0]} field") from e
        token_types: list[int] = meta.get("tokenizer.ggml.token_type", [gguf_vocab.GGUF_TOKEN_NORMAL] * len(tokens))
        if model_type == "gpt2":
            tokenizer, add_bos = gguf_vocab.byte_level_bpe(path, meta, tokens)
        elif model_type == "llama":
            tokenizer, add_bos = gguf_vocab.sentencepiece_bpe(path, meta, tokens, token_types)
        elif model_type == "bert":  # an encoder's: pooling models only (kvyard/pooling_model.py)
            tokenizer, add_bos = gguf_vocab.wordpiece(path, meta, tokens, token_types)
        elif model_type == "t5":  # XLM-RoBERTa's SentencePiece Unigram: pooling models only, as "bert"
            tokenizer, add_bos = gguf_vocab.unigram(path, meta, tokens, token_types)
        else:
            raise ModelFileError(gguf_vocab.unsupported_model(model_type, path))
        control = [i for i, t in enumerate(token_types) if t == gguf_vocab.GGUF_TOKEN_CONTROL]
        # The ids already exist in the vocab, so adding them keeps their ids; normalized=False matches them
        # verbatim in the raw text. User-defined tokens (Qwen's <tool_call>) are matched whole too, but
        # are plain text, never special.
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                              for i, t in enumerate(token_types) if t == gguf_vocab.GGUF_TOKEN_USER_DEFINED])

        templates: dict[str, str] = {}
        if isinstance(meta.get("tokenizer.chat_template"), str):
            templates["default"] = meta["tokenizer.chat_template"]
        for name in meta.get("tokenizer.chat_templates", []) or []:
            named = meta.get(f"tokenizer.chat_template.{name}")
            if isinstance(named, str):
                templates[name] = named
        eos = gguf_vocab.opt_int(meta.get("tokenizer.ggml.eos_token_id"))
        # Llama 3's turns end with <|eot_id|> (eot), tool calls with <|eom_id|> (eom), besides eos.
        stops = {gguf_vocab.opt_int(meta.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")}
        flag = meta.get("tokenizer.ggml.add_bos_token")
        return cls(
            tokenizer,
            bos_token_id=gguf_vocab.opt_int(meta.get("tokenizer.ggml.bos_token_id",
                                                     meta.get("tokenizer.ggml.cls_token_id"))),  # BERT's [CLS]
            eos_token_id=eos,
            chat_templates=templates,
            add_bos_token=bool(add_bos if flag is None else flag),
            special_token_ids=frozenset(control),
            stop_token_ids=frozenset(i for i in stops if i is not None),
            special_tokens_map=special_tokens.from_gguf(meta, tokens, control),
        )

    @classmethod
    def _from_hf_dir(cls, path: Path) -> TextTokenizer:
        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelFileError(f"cannot load {path / 'tokenizer.json'}: {e}") from e
        config = _json_file(path / "tokenizer_config.json")

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
            stop_token_ids=_generation_eos_ids(path, tokenizer.get_vocab_size(with_added_tokens=True)),
            special_tokens_map=special_tokens.from_hf_config(_json_file(path / "special_tokens_map.json"), config),
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

    def token_id(self, piece: str) -> int | None:
        """The id of a vocabulary piece (e.g. "<|eot_id|>"), or None when the vocabulary lacks it."""
        return self._parse.token_to_id(piece)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, when its piece spells them: a byte-level piece ('Ġworld'), a
        SentencePiece one ('▁world', '<0xE4>'). None for special tokens and pieces that spell no bytes."""
        piece = self.id_to_piece(token_id)
        if token_id in self.special_token_ids:
            return None
        if self._spm:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    return None
            return piece.replace("\u2581", " ").encode("utf-8")
        table = _byte_level_alphabet()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None

    def to_json(self) -> str:
        """tokenizer.json's text (what grammar libraries such as llguidance build their token tables from)."""
        return self._parse.to_str()

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json, e.g. to turn a GGUF's tokenizer into a Hugging Face tokenizer dir."""
        self._parse.save(str(path))


def pooling_tokenizer(path: Path) -> Tokenizer:
    """What a pooling model's inputs are encoded with, its encode(add_special_tokens=True) adding what the model
    expects: a directory's tokenizer.json as it is (its post-processor decides); a GGUF's vocabulary with BOS
    where `tokenizer.ggml.add_bos_token` (or the tokenizer model's default) says, EOS where
    `tokenizer.ggml.add_eos_token` (a Unigram vocabulary's default: yes) says and the separator between a pair's
    texts where `tokenizer.ggml.add_sep_token` says, as llama.cpp adds them when it embeds and reranks
    (Qwen3-Embedding's inputs end with its <|endoftext|>, XLM-R's pairs are <s> A </s></s> B </s>); a BERT
    GGUF's WordPiece with [CLS] before and [SEP] after."""
    if (static := static_embedding(path)) is not None:  # sentence-transformers encodes without special tokens
        tok = Tokenizer.from_file(str(static / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
        return tok
    if not is_gguf(path):
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    text = TextTokenizer.from_path(path)
    tok = Tokenizer.from_str(text.to_json())  # a copy: its post-processor is set below
    meta = gguf_vocab.gguf_metadata(path)
    if meta.get("tokenizer.ggml.model") == "bert":  # [CLS] text [SEP], as llama.cpp's WordPiece adds them
        cls, sep = text.bos_token_id, gguf_vocab.opt_int(meta.get("tokenizer.ggml.seperator_token_id"))
        cls = tok.token_to_id("[CLS]") if cls is None else cls
        sep = tok.token_to_id("[SEP]") if sep is None else sep
        if cls is None or sep is None:
            raise ModelFileError(f"{path}: a WordPiece GGUF needs its [CLS] and [SEP] tokens")
        c, e = tok.id_to_token(cls), tok.id_to_token(sep)
        tok.post_processor = processors.TemplateProcessing(single=f"{c} $A {e}", pair=f"{c} $A {e} $B:1 {e}:1",
                                                           special_tokens=[(c, cls), (e, sep)])
        return tok
    model = meta.get("tokenizer.ggml.model")
    ends = []
    if text.add_bos_token:
        ends.append(("bos", text.bos_token, text.bos_token_id))
    if meta.get("tokenizer.ggml.add_eos_token", model == "t5"):  # llama.cpp's Unigram default: EOS added
        ends.append(("eos", text.eos_token, text.eos_token_id))
    if meta.get("tokenizer.ggml.add_sep_token"):  # between a pair's texts (XLM-R: <s> A </s></s> B </s>)
        sep_id = gguf_vocab.opt_int(meta.get("tokenizer.ggml.seperator_token_id"))
        ends.append(("sep", None if sep_id is None else tok.id_to_token(sep_id), sep_id))
    for what, token, token_id in ends:
        if token is None or token_id is None:
            raise ModelFileError(f"{path}: the GGUF asks for a {what} token on every input but names none")
    bos, eos, sep = ([t for w, t, _ in ends if w == which] for which in ("bos", "eos", "sep"))
    second = 1 if int(meta.get("tokenizer.ggml.token_type_count", 2)) > 1 else 0  # XLM-R has one segment type
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join([*bos, "$A", *eos]),
        pair=" ".join([*bos, "$A", *eos, *sep, f"$B:{second}", *(f"{e}:{second}" for e in eos)]),
        special_tokens=list({t: (t, i) for _, t, i in ends}.values()))
    return tok


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's table), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict.fromkeys(printable), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c if c is not None else b): b for b, c in chars.items()}


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object a tokenizer directory may hold ({} when the file is absent)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ModelFileError(f"{path} is not a JSON object")
    return config


def _generation_eos_ids(path: Path, vocab_size: int) -> frozenset[int]:
    """generation_config.json's eos_token_id (an id or a list: Llama 3.1 Instruct stops on
    <|end_of_text|>, <|eom_id|> and <|eot_id|>)."""
    config_path = path / "generation_config.json"
    if not config_path.is_file():
        return frozenset()
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelFileError(f"cannot read {config_path}: {e}") from e
    ids = raw if isinstance(raw, list) else [] if raw is None else [raw]
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise ModelFileError(f"{config_path}: eos_token_id {raw!r} is not a list of ids in the vocabulary")
    return frozenset(ids)


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

