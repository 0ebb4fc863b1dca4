"""The model's architecture numbers, read once from GGUF metadata or a Hugging Face config.json.

One model file (backend/model.py) serves every family accepted here; what differs is switched by these
fields: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied head, RoPE scaling (Llama 3.1+, Qwen2.5's YaRN, linear, dynamic NTK) and
a sliding attention window (Mistral). Anything this file cannot honour is a ModelFileError naming it,
never accepted and silently ignored."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.gguf_meta import read_gguf_metadata, read_gguf_vector
from kvyard.model_path import ModelFileError, is_gguf
from kvyard.qwen_vl_config import QWEN_VL_MODEL_TYPES, qwen_text_config
from kvyard.vision_config import VISION_MODEL_TYPES, ImageSide, load_vision_config

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# The keys each rope type reads from rope_scaling / rope_parameters; any other key is refused (a key we do
# not read would change the model's numbers without us knowing).
_COMMON_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for a longer context than the model was pretrained on."""
    rope_type: str                 # "linear", "dynamic", "yarn" or "llama3"
    factor: float                  # context extension factor
    original_max_position_embeddings: int  # the pretraining context the factor extends
    low_freq_factor: float = 1.0   # llama3: wavelengths above original/low_freq_factor are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    beta_fast: float = 32.0        # yarn: rotations at which extrapolation starts
    beta_slow: float = 1.0         # yarn: rotations at which interpolation ends
    attention_factor: float = 1.0  # yarn: scale on cos and sin (so on q·k twice)
    truncate: bool = True          # yarn: round the correction range to whole dimensions
    freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs: each frequency divided by its factor


@dataclass(frozen=True)
class ModelConfig:
    architecture: str          # "llama", "mistral", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int           # D
    intermediate_size: int     # F, the SwiGLU width
    num_layers: int
    num_heads: int             # H, query heads
    num_kv_heads: int          # Hkv, key/value heads (GQA when < H)
    head_dim: int              # d = D / H unless the checkpoint says otherwise
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int  # the context served: the trained one, extended by yarn / dynamic scaling
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    attention_bias: bool       # q/k/v projections have a bias (Qwen2)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    sliding_window: int = 0    # keys a query sees, itself included (Mistral); 0: all of them
    window_layers: tuple[bool, ...] | None = None  # per layer, whether the window applies; None: every layer
    vision: ImageSide | None = None  # a vision-language model's image side (LLaVA, Qwen-VL); None: text only
    qk_norm: bool = False      # RMSNorm over each head of q and k before RoPE (Qwen3)
    mrope_section: tuple[int, ...] | None = None  # Qwen-VL's M-RoPE: frequencies rotated by t, h, w positions

    def layer_window(self, layer: int) -> int:
        """The attention window of one layer (0: unbounded)."""
        if not self.sliding_window or (self.window_layers is not None and not self.window_layers[layer]):
            return 0
        return self.sliding_window


def load_model_config(path: Path) -> ModelConfig:
    return _from_gguf(path) if is_gguf(path) else _from_hf_dir(path)


# ---- GGUF ---------------------------------------------------------------------------------------

def _from_gguf(path: Path) -> ModelConfig:
    meta = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"{path}: GGUF architecture '{arch}' is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path}: GGUF metadata lacks '{arch}.{key}'")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelFileError(f"{path}: key and value head sizes differ, which this engine does not support")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelFileError(f"{path}: RoPE over {get('rope.dimension_count')} of {head_dim} dimensions "
                             "(partial rotary) is not supported")
    if meta.get(f"{arch}.expert_count"):
        raise ModelFileError(f"{path}: mixture-of-experts models are not supported")
    context = int(get("context_length"))
    rope = _gguf_rope_scaling(path, meta, arch, context, head_dim)
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if meta.get(f"{arch}.attention.sliding_window_pattern") is not None:
        raise ModelFileError(f"{path}: per-layer sliding-window patterns are not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=_served_context(context, rope),
        tie_word_embeddings=False,  # decided by the weights: no `output` tensor means tied
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",  # blk.N.attn_q_norm / attn_k_norm: RMSNorm over each head's q and k
        rope_scaling=rope,
        sliding_window=window,
    )


def _gguf_rope_scaling(path: Path, meta: dict[str, Any], arch: str, context: int,
                       head_dim: int) -> RopeScaling | None:
    """llama.cpp's keys: rope.scaling.{type, factor, original_context_length, attn_factor, yarn_*}, and
    for Llama 3.1+ no type at all but a `rope_freqs` tensor of per-frequency divisors."""
    prefix = f"{arch}.rope.scaling."
    kind = str(meta.get(prefix + "type") or "none")
    factor = float(meta.get(prefix + "factor") or meta.get(f"{arch}.rope.scale_linear") or 1.0)
    original = int(meta.get(prefix + "original_context_length") or context)
    for key in ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor", "alpha"):
        if meta.get(prefix + key):
            raise ModelFileError(f"{path}: RoPE scaling key '{prefix}{key}' is not supported")
    freqs = read_gguf_vector(path, "rope_freqs.weight")
    if freqs is not None:
        if len(freqs) != head_dim // 2:
            raise ModelFileError(f"{path}: rope_freqs has {len(freqs)} values, expected {head_dim // 2}")
        if kind not in ("none", "linear") or factor != 1.0:
            raise ModelFileError(f"{path}: rope_freqs together with RoPE scaling '{kind}' is not supported")
        return RopeScaling("llama3", 1.0, original, freq_factors=tuple(float(f) for f in freqs))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor, context)
    if kind == "yarn":
        attn = float(meta.get(prefix + "attn_factor") or 1.0)
        return RopeScaling("yarn", factor, original, attention_factor=attn * _yarn_mscale(factor),
                           beta_fast=float(meta.get(prefix + "yarn_beta_fast") or 32.0),
                           beta_slow=float(meta.get(prefix + "yarn_beta_slow") or 1.0))
    raise ModelFileError(f"{path}: RoPE scaling type '{kind}' is not supported "
                         f"(supported: none, linear, yarn, and llama3 through rope_freqs)")


# ---- Hugging Face config.json -------------------------------------------------------------------

def _from_hf_dir(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFileError(f"{path}: no config.json")
    cfg = json.loads(config_file.read_text())
    vision, mrope = None, None
    if cfg.get("model_type") in QWEN_VL_MODEL_TYPES:
        vision = load_vision_config(path)
        cfg, mrope = qwen_text_config(path, cfg)
    elif cfg.get("model_type") in VISION_MODEL_TYPES:  # the language model is its text_config
        vision = load_vision_config(path)
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **(cfg.get("text_config") or {})}
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path}: model_type '{model_type}' is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelFileError(f"{path}: hidden_act '{act}' is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise ModelFileError(f"{path}: mlp_bias is not supported")
    if model_type in ("llama", "qwen3") and cfg.get("attention_bias"):
        raise ModelFileError(f"{path}: {model_type} attention_bias (a bias on o_proj too) is not supported")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(cfg["num_hidden_layers"])
    trained = int(cfg.get("max_position_embeddings", 4096))
    theta, rope = _hf_rope(path, cfg, trained, head_dim)
    window, window_layers = _hf_window(path, cfg, model_type, layers)
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_served_context(trained, rope),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",  # Qwen2's q/k/v always have one; o never does
        rope_scaling=rope,
        sliding_window=window,
        window_layers=window_layers,
        vision=vision,
        qk_norm=model_type == "qwen3",
        mrope_section=mrope,
    )


def _hf_rope(path: Path, cfg: dict[str, Any], trained: int, head_dim: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling from transformers 4's `rope_theta` + `rope_scaling` or transformers 5's
    `rope_parameters` (which holds rope_theta too); a value in both places must agree."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ModelFileError(f"{path}: {key} must be an object, got {value!r}")
        if any(isinstance(v, dict) for v in value.values()):
            raise ModelFileError(f"{path}: per-layer-type RoPE parameters ({key}) are not supported")
        for k, v in value.items():
            if k in params and params[k] != v and {k} != {"type"}:
                raise ModelFileError(f"{path}: rope_scaling and rope_parameters disagree on {k!r}")
            params[k] = v
    if "rope_theta" in cfg and "rope_theta" in params and float(cfg["rope_theta"]) != float(params["rope_theta"]):
        raise ModelFileError(f"{path}: rope_theta {cfg['rope_theta']} and rope_parameters.rope_theta "
                             f"{params['rope_theta']} disagree")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind not in ROPE_TYPES:
        raise ModelFileError(f"{path}: RoPE type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")
    unknown = set(params) - _COMMON_ROPE_KEYS - _ROPE_KEYS[kind]
    if unknown:
        raise ModelFileError(f"{path}: RoPE type '{kind}' with {', '.join(sorted(unknown))}: not supported")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if partial != 1.0:
        raise ModelFileError(f"{path}: partial_rotary_factor {partial} is not supported")
    if kind == "default":
        return theta, None

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise ModelFileError(f"{path}: RoPE type '{kind}' needs '{key}'")
        return params[key]

    factor = float(need("factor"))
    if not factor >= 1.0:
        raise ModelFileError(f"{path}: RoPE scaling factor {factor} must be at least 1")
    if kind in ("linear", "dynamic"):
        return theta, RopeScaling(kind, factor, trained)
    original = int(params.get("original_max_position_embeddings") or trained)
    if kind == "llama3":
        low, high = float(need("low_freq_factor")), float(need("high_freq_factor"))
        if not high > low > 0:
            raise ModelFileError(f"{path}: llama3 RoPE needs high_freq_factor > low_freq_factor > 0")
        return theta, RopeScaling(kind, factor, original, low_freq_factor=low, high_freq_factor=high)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
                     if mscale and mscale_all else _yarn_mscale(factor))
    return theta, RopeScaling(kind, factor, original, attention_factor=float(attention),
                              beta_fast=float(params.get("beta_fast") or 32.0),
                              beta_slow=float(params.get("beta_slow") or 1.0),
                              truncate=bool(params.get("truncate", True)))


def _hf_window(path: Path, cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int, tuple[bool, ...] | None]:
    """Mistral: `sliding_window` on every layer (null: none). Qwen2: only with use_sliding_window, on the
    layers from max_window_layers on, or as transformers 5's `layer_types` list says."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if model_type == "llama" and window:
        raise ModelFileError(f"{path}: sliding_window on a Llama config is not supported")
    if not window:
        return 0, None
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
            raise ModelFileError(f"{path}: layer_types {types!r} are not supported")
        flags = tuple(t == "sliding_attention" for t in types)
    elif model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", layers))
        flags = tuple(i >= first for i in range(layers))
    else:
        flags = tuple(True for _ in range(layers))
    return int(window), None if all(flags) else flags


# ---- shared -------------------------------------------------------------------------------------

def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1·mscale·ln(factor) + 1 for factor > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _served_context(trained: int, rope: RopeScaling | None) -> int:
    """The context to serve: yarn and dynamic NTK exist to run past the pretraining length (Qwen2.5's
    32K config with yarn factor 4 serves 128K); linear and llama3 configs already state the longer one."""
    if rope is not None and rope.rope_type in ("yarn", "dynamic"):
        return max(trained, int(rope.original_max_position_embeddings * rope.factor))
    return trained
