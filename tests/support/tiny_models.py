"""Tiny random-weight models of each family, saved the ways people ship them: a Hugging Face directory
(transformers' own save_pretrained, tokenizer.json, chat template, generation_config) and a GGUF written
the way llama.cpp's converter lays one out (the `gguf` package's writer: tensor names, Llama's Q/K row
interleave, rope_freqs for Llama 3.1, tokenizer metadata). Their tokenizers are trained here too
(tests/support/tiny_tokenizers.py)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from renderers.llama3 import LLAMA3_TEMPLATE  # the Llama 3 header format, as a model would ship it
from tests.support.tiny_tokenizers import (CHATML_TEMPLATE, LLAMA3_SPECIALS, MISTRAL_TEMPLATE, QWEN2_SPECIALS,
                                           TokenizerSpec, add_gguf_tokenizer, byte_level_tokenizer, save_hf_tokenizer,
                                           sentencepiece_tokenizer)

# ---- models -----------------------------------------------------------------------------------------

@dataclass
class TinyModel:
    family: str                   # "llama", "qwen2", "qwen3" or "mistral"
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
    elif family in ("qwen2", "qwen3"):
        spec = byte_level_tokenizer("qwen2", specials=QWEN2_SPECIALS, user_defined=("<tool_call>", "</tool_call>"))
        spec.specials = {"eos": "<|im_end|>"}
        cls, template = (transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config), CHATML_TEMPLATE
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
    if head_dim is not None or family == "qwen3":  # Qwen3Config's own default would be 128
        kwargs["head_dim"] = head_dim or hidden // heads
    if family == "mistral":
        kwargs["sliding_window"] = sliding_window
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    model.eval()
    return TinyModel(family, model, spec, template)


def randomize(model: Any, bias: float = 0.5, norms: tuple[str, ...] = ("norm.weight",)) -> None:
    """Random weights with visible norms and biases (the defaults are ones and zeros)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(norms):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(bias * torch.randn_like(p))
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


def write_gguf(tiny: TinyModel, path: Path, types: dict[str, str] | None = None, *,
               pooling: gguf.PoolingType | None = None, add_eos: bool = False,
               rerank: tuple[int, int] | None = None) -> Path:
    """The model as llama.cpp's converter writes it, every matrix in `types[role]` (default F32). Types the
    gguf package cannot quantize (Q4_K, Q5_K, Q6_K) get random valid blocks; the transformers model's
    weights are then set to exactly what the file holds, so both compute on the same numbers.
    pooling: `{arch}.pooling_type`, as the converter writes it for an embedding model (Qwen3-Embedding:
    LAST); add_eos: `tokenizer.ggml.add_eos_token` (Qwen3-Embedding's inputs end with its eos). rerank: the ids
    of "yes" and "no", written as llama.cpp's converter writes a Qwen3-Reranker: pooling type RANK, labels
    ["yes", "no"], the model card's prompt as the `rerank` chat template (with {query} and {document}), and
    `cls.output.weight` = the LM head's yes and no rows in place of the untied head."""
    cfg, model, family = tiny.config, tiny.hf_model, tiny.family
    arch = family if family in ("qwen2", "qwen3") else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    if rerank is not None:
        from kvyard.pooling_model import qwen3_reranker_prompt
        pooling = gguf.PoolingType.RANK
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": qwen3_reranker_prompt("{query}", "{document}")}])
    if pooling is not None:
        w.add_pooling_type(pooling)
    if add_eos:
        w.add_add_eos_token(True)
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
    if rerank is not None:  # the head's yes and no rows (the exact values the model then holds), nothing else of it
        head = model.lm_head.weight if not cfg.tie_word_embeddings else model.model.embed_tokens.weight
        w.add_tensor("cls.output.weight", head.detach()[list(rerank)].float().numpy().copy())
    elif not cfg.tie_word_embeddings:
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
        if family == "qwen3":
            put(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", "norm")
            put(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", "norm")
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
