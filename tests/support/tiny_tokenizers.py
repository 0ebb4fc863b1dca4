"""Tiny tokenizers of each family, trained here (no model hub), with what a GGUF and a Hugging Face directory
store about them (tests/support/tiny_models.py puts them beside random-weight models).

The references are built through `tokenizers` with the pre-tokenizer regexes transformers ships for each
family (and transformers' own tokenizer classes where it has them), so the GGUF tokenizer kvyard rebuilds
from metadata is checked against an independent construction."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# ---- text -------------------------------------------------------------------------------------------

_PIECES = [
    "Hello", " world", "The quick brown fox", " jumps over the lazy dog.", " a", " the", " of", " and",
    "12345", "3.14159", "1,000,000", " 2024-11-24", " 42", "0x1F", "7th", "１２３",
    "你好，世界", "日本語のテキストです", "한국어 문장", "Привет, мир", "café", "e\u0301", "naïve", "Ω≈ç√",
    "🤖", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "✓",
    "def f(x):\n    return x ** 2\n", "if (a && b) { return c[i]; }", "<div class=\"x\">", "SELECT * FROM t;",
    "   ", "\t\t", "\n\n\n", "  \n ", " ", "I'm", "YOU'LL", "don't", "it's", "'s", "...", "!!!", "$100",
    "a/b/c", "\r\n", "x=1;y=2", "    indented", "trailing   ", "CamelCaseWord", "snake_case_name",
]


def sample_texts(n: int, seed: int) -> list[str]:
    """n strings of 1-6 pieces: digits, CJK, emoji, code, whitespace runs, contractions, accents."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 6))) for _ in range(n)]


# ---- tokenizers -------------------------------------------------------------------------------------

def _family_split(pre: str) -> str:
    """The split regex transformers ships for a family (its copy of the model's tokenizer.json)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    return PRETOKENIZE_REGEX if pre == "qwen2" else GGUF_PRE_TOKENIZER_SPLITS[pre]


@dataclass
class TokenizerSpec:
    """A trained reference tokenizer and what a GGUF stores about it."""
    pre: str                        # llama.cpp's pre-tokenizer name, or "spm" (SentencePiece, model "llama")
    reference: Any                  # encodes text the way the family's own tokenizer.json does
    tokens: list[str]               # the vocabulary by id, as the GGUF stores it
    token_types: list[int]          # llama.cpp token types
    merges: list[str] = field(default_factory=list)   # byte-level BPE merges ("a b")
    scores: list[float] = field(default_factory=list)  # SentencePiece scores
    specials: dict[str, str] = field(default_factory=dict)  # role → token: bos, eos, eot, eom, unk
    space_prefix: bool = True       # SentencePiece: "▁" put in front of the text (Gemma's vocabularies: no)

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def byte_level_tokenizer(pre: str, vocab_size: int = 600, specials: tuple[str, ...] = (),
                         user_defined: tuple[str, ...] = (), seed: int = 1) -> TokenizerSpec:
    """A byte-level BPE trained on sample_texts, split the way family `pre` splits: "gpt-2", "smollm"
    (each digit alone first), "llama-bpe" (Llama 3), "qwen2", "tekken" (Mistral Nemo)."""
    tok = Tokenizer(models.BPE(ignore_merges=pre in ("llama-bpe", "tekken")))
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_family_split(pre)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample_texts(3000, seed), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    size = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(size)]
    types = [3 if t in specials else 4 if t in user_defined else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return TokenizerSpec(pre, tok, tokens, types, merges=merges)


def sentencepiece_tokenizer(vocab_size: int = 500, extra_specials: tuple[str, ...] = (), seed: int = 2,
                            space_prefix: bool = True) -> TokenizerSpec:
    """A SentencePiece-style BPE vocabulary as Llama 2 / Mistral GGUFs store it: <unk>, <s>, </s>, the 256
    <0xNN> byte tokens, then pieces with scores (a merged piece scores minus its merge's rank). The
    reference is transformers' LlamaTokenizer built from those pieces and scores. space_prefix False: as
    Gemma's (`add_space_prefix` false in the GGUF): spaces become "▁" and nothing is put in front."""
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  limit_alphabet=120)
    trained.train_from_iterator(sample_texts(3000, seed), trainer)
    model = json.loads(trained.to_str())["model"]
    merged = {("".join(m) if not isinstance(m, str) else m.replace(" ", "")): r for r, m in enumerate(model["merges"])}
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in ("<unk>", "<s>", "</s>")]
    specials = ["<unk>", "<s>", "</s>", *extra_specials]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(merged.get(p, len(merged) + i)) for i, p in enumerate(pieces)]
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: s for t, s, k in zip(tokens, scores, types) if k == 1}
    # transformers' merges from the scores, in Llama 2's tokenizer.json structure (sentencepiece's and
    # llama.cpp's space handling: "▁" in front of every stretch of text, even one starting with a space).
    reference = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, normal)).backend_tokenizer
    reference.normalizer = normalizers.Sequence([*([normalizers.Prepend("\u2581")] if space_prefix else []),
                                                 normalizers.Replace(" ", "\u2581")])
    reference.pre_tokenizer = None
    reference.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *([decoders.Strip(" ", 1, 0)] if space_prefix else [])])
    reference.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return TokenizerSpec("spm", reference, tokens, types, scores=scores,
                         specials={"unk": "<unk>", "bos": "<s>", "eos": "</s>"}, space_prefix=space_prefix)


def add_gguf_tokenizer(w: gguf.GGUFWriter, spec: TokenizerSpec, chat_template: str | None = None) -> None:
    if spec.pre == "spm":
        w.add_tokenizer_model("llama")
        w.add_token_scores(spec.scores)
        w.add_add_space_prefix(spec.space_prefix)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec.pre)
        w.add_token_merges(spec.merges)
    w.add_token_list(spec.tokens)
    w.add_token_types(spec.token_types)
    for role, token in spec.specials.items():
        getattr(w, {"bos": "add_bos_token_id", "eos": "add_eos_token_id", "eot": "add_eot_token_id",
                    "eom": "add_eom_token_id", "unk": "add_unk_token_id"}[role])(spec.id(token))
    if chat_template is not None:
        w.add_chat_template(chat_template)


def save_hf_tokenizer(spec: TokenizerSpec, path: Path, chat_template: str | None) -> None:
    """tokenizer.json, tokenizer_config.json (bos/eos, chat template) beside the model."""
    backend = spec.reference if isinstance(spec.reference, Tokenizer) else spec.reference.backend_tokenizer
    backend.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {k + "_token": v for k, v in spec.specials.items() if k in ("bos", "eos")}
    config["add_bos_token"] = False
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


# ---- chat templates (written here for the tests; each family's turn format) -------------------------

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
