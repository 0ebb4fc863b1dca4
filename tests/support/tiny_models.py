"""Tiny random-weight models of each family, saved the ways people ship them: a Hugging Face directory
(transformers' own save_pretrained, tokenizer.json, chat template, generation_config) and a GGUF written
the way llama.cpp's converter lays one out (the `gguf` package's writer: tensor names, Llama's Q/K row
interleave, rope_freqs for Llama 3.1, tokenizer metadata). No model hub: tokenizers are trained here.

The tokenizer references are built through `tokenizers` with the pre-tokenizer regexes transformers
ships for each family (and transformers' own tokenizer classes where it has them), so the GGUF tokenizer
kvyard rebuilds from metadata is checked against an independent construction."""
from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from renderers.llama3 import LLAMA3_TEMPLATE  # the Llama 3 header format, as a model would ship it

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


def sentencepiece_tokenizer(vocab_size: int = 500, extra_specials: tuple[str, ...] = (), seed: int = 2) -> TokenizerSpec:
    """A SentencePiece-style BPE vocabulary as Llama 2 / Mistral GGUFs store it: <unk>, <s>, </s>, the 256
    <0xNN> byte tokens, then pieces with scores (a merged piece scores minus its merge's rank). The
    reference is transformers' LlamaTokenizer built from those pieces and scores."""
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
    reference.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    reference.pre_tokenizer = None
    reference.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    reference.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return TokenizerSpec("spm", reference, tokens, types, scores=scores,
                         specials={"unk": "<unk>", "bos": "<s>", "eos": "</s>"})


def add_gguf_tokenizer(w: gguf.GGUFWriter, spec: TokenizerSpec, chat_template: str | None = None) -> None:
    if spec.pre == "spm":
        w.add_tokenizer_model("llama")
        w.add_token_scores(spec.scores)
        w.add_add_space_prefix(True)
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


# ---- models -----------------------------------------------------------------------------------------

@dataclass
class TinyModel:
    family: str                   # "llama", "qwen2" or "mistral"
    hf_model: Any                 # the transformers model (float32, eval): the reference
    tokenizer: TokenizerSpec
    chat_template: str

    @property
    def config(self) -> Any:
        return self.hf_model.config


def tiny_model(family: str, *, rope: dict[str, Any] | None = None, sliding_window: int | None = None,
               tie: bool = False, max_positions: int = 256, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               layers: int = 2, seed: int = 0, head_dim: int | None = None) -> TinyModel:
    """A random transformers model of the family with a tokenizer trained for it (vocab = the tokenizer's).
    Sizes keep head_dim ≥ 32 and every width a multiple of 256 (the kernels' and Q4_K's blocks), unless
    head_dim is given (the checkpoint then states it, as head sizes other than hidden / heads do)."""
    import transformers

    if family == "llama":
        spec = byte_level_tokenizer("llama-bpe", specials=LLAMA3_SPECIALS)
        spec.specials = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "eot": "<|eot_id|>", "eom": "<|eom_id|>"}
        cls, template = transformers.LlamaConfig, LLAMA3_TEMPLATE
    elif family == "qwen2":
        spec = byte_level_tokenizer("qwen2", specials=QWEN2_SPECIALS, user_defined=("<tool_call>", "</tool_call>"))
        spec.specials = {"eos": "<|im_end|>"}
        cls, template = transformers.Qwen2Config, CHATML_TEMPLATE
    elif family == "mistral":
        spec = sentencepiece_tokenizer(extra_specials=("[INST]", "[/INST]"))
        cls, template = transformers.MistralConfig, MISTRAL_TEMPLATE
    else:
        raise ValueError(family)
    vocab = len(spec.tokens)
    kwargs: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                                  tie_word_embeddings=tie)
    if rope is not None:
        kwargs["rope_parameters"] = rope
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if family == "mistral":
        kwargs["sliding_window"] = sliding_window
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.eval()
    return TinyModel(family, model, spec, template)


def randomize(model: Any) -> None:
    """Random weights with visible norms and biases (the defaults are ones and zeros)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)


def save_hf_dir(tiny: TinyModel, path: Path, *, max_shard_size: str | None = None,
                transformers4_config: bool = False) -> Path:
    """save_pretrained (sharded with an index when max_shard_size is small) plus the tokenizer files.
    transformers4_config: rewrite config.json the way transformers 4 wrote it (rope_theta and
    rope_scaling at the top level instead of rope_parameters)."""
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    tiny.hf_model.save_pretrained(str(path), **kwargs)
    if transformers4_config:
        cfg = json.loads((path / "config.json").read_text())
        params = dict(cfg.pop("rope_parameters", None) or {})
        cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
        if params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(cfg))
    save_hf_tokenizer(tiny.tokenizer, path, tiny.chat_template)
    stops = [tiny.tokenizer.id(t) for k, t in tiny.tokenizer.specials.items() if k in ("eos", "eot", "eom")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(set(stops))}))
    return path


# GGUF tensor types of the layers, by role: served as they are, or converted exactly (Q4_0 → Q4_1).
EXACT_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
               "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0", "token_embd": "Q8_0", "output": "Q8_0"}
# ... Q4_K → Q4_1: the same codes, the scale products rounded to float16.
Q4_K_TYPES = {**EXACT_TYPES, "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "attn_output": "Q4_K"}
# ... and requantized to Q8_0 at load (and q/k/v mixed, so the fused qkv goes Q8_0 too).
REQUANTIZED_TYPES = {"attn_q": "Q5_0", "attn_k": "Q4_1", "attn_v": "Q6_K", "attn_output": "F16",
                     "ffn_gate": "Q5_1", "ffn_up": "Q5_K", "ffn_down": "BF16", "token_embd": "Q6_K", "output": "F32"}


def write_gguf(tiny: TinyModel, path: Path, types: dict[str, str] | None = None) -> Path:
    """The model as llama.cpp's converter writes it, every matrix in `types[role]` (default F32). Types the
    gguf package cannot quantize (Q4_K, Q5_K, Q6_K) get random valid blocks; the transformers model's
    weights are then set to exactly what the file holds, so both compute on the same numbers."""
    cfg, model, family = tiny.config, tiny.hf_model, tiny.family
    arch = "qwen2" if family == "qwen2" else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = dict(cfg.rope_parameters or {})
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    kind = rope.get("rope_type", "default")
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind not in ("default", "llama3"):
        raise ValueError(f"GGUF has no {kind} RoPE")
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(int(cfg.sliding_window))
    add_gguf_tokenizer(w, tiny.tokenizer, tiny.chat_template)
    types = types or {}
    state = model.state_dict()
    if kind == "llama3":  # the converter stores Llama 3.1's frequency divisors as a tensor
        w.add_tensor("rope_freqs.weight", _llama3_freq_factors(cfg).astype(np.float32))
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads

    def put(gguf_name: str, hf_name: str, role: str, permute_heads: int = 0) -> None:
        t = state[hf_name]
        values = t.detach().float().numpy()
        if values.ndim == 1:
            w.add_tensor(gguf_name, values.astype(np.float32))
            return
        if permute_heads:  # llama.cpp interleaves each head's rows: RoPE pairs (2i, 2i+1) adjacent
            n = values.shape[0]
            values = values.reshape(permute_heads, 2, n // permute_heads // 2, -1).swapaxes(1, 2).reshape(n, -1)
        qtype = gguf.GGMLQuantizationType[types.get(role, "F32")]
        raw = _encode(values, qtype)
        w.add_tensor(gguf_name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
        exact = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(values.shape)
        if permute_heads:
            n = exact.shape[0]
            exact = exact.reshape(permute_heads, n // permute_heads // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)
        with torch.no_grad():
            t.copy_(torch.from_numpy(exact))

    put("token_embd.weight", "model.embed_tokens.weight", "token_embd")
    put("output_norm.weight", "model.norm.weight", "norm")
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight", "output")
    interleave = arch == "llama"
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight", "norm")
        put(b + "attn_q.weight", p + "self_attn.q_proj.weight", "attn_q", heads if interleave else 0)
        put(b + "attn_k.weight", p + "self_attn.k_proj.weight", "attn_k", kv_heads if interleave else 0)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", "attn_v")
        if family == "qwen2":
            for x in "qkv":
                put(b + f"attn_{x}.bias", p + f"self_attn.{x}_proj.bias", "bias")
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", "attn_output")
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", "norm")
        put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", "ffn_gate")
        put(b + "ffn_up.weight", p + "mlp.up_proj.weight", "ffn_up")
        put(b + "ffn_down.weight", p + "mlp.down_proj.weight", "ffn_down")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """values [n, k] float32 → the tensor's GGUF data. K-quants have no quantizer in the gguf package:
    random blocks with small scales (valid data, near the weights' scale, not fitted to them)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return values.astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = values.shape
    if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
        rng = np.random.default_rng(n * 7 + k)
        raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
        if qtype.name == "Q6_K":  # ql, qh, 16 int8 scales, then f16 d
            raw[..., 192:208] = rng.integers(1, 32, size=(n, k // block, 16), dtype=np.int8).view(np.uint8)
            raw[..., 208:210] = np.full((n, k // block, 1), 0.0002, dtype=np.float16).view(np.uint8)
        else:  # f16 d, f16 dmin, then scales
            raw[..., 0:2] = np.full((n, k // block, 1), 0.0002, dtype=np.float16).view(np.uint8)
            raw[..., 2:4] = np.full((n, k // block, 1), 0.0003, dtype=np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def _llama3_freq_factors(cfg: Any) -> np.ndarray:
    """What llama.cpp's converter computes for Llama 3.1 RoPE: per frequency, the divisor of its
    inverse wavelength (1 for short wavelengths, the factor for long ones, blended between)."""
    import math
    rope = cfg.rope_parameters
    d = cfg.hidden_size // cfg.num_attention_heads
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, d, 2):
        freq = 1.0 / base ** (i / d)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_greedy(hf_model: Any, ids: Sequence[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was picked from, with transformers' own KV cache (the reference)."""
    tokens: list[int] = []
    step_logits: list[torch.Tensor] = []
    with torch.inference_mode():
        out = hf_model(input_ids=torch.tensor([list(ids)]), use_cache=True)
        for _ in range(steps):
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            step_logits.append(logits)
            out = hf_model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                           use_cache=True)
    return tokens, step_logits
