"""A Qwen2-VL / Qwen2.5-VL checkpoint's image side, read once from config.json and preprocessor_config.json:
the tower's shape (backend/qwen_vl_tower.py), dynamic-resolution preprocessing (backend/image_preprocess.py)
and how many placeholder tokens an image of a given size takes (the frontend expands each image's one
`<|image_pad|>` into that many), plus the language model's part of config.json with its M-RoPE sections."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.model_path import ModelFileError

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_TOWER_ACTS = {"qwen2_vl": ("quick_gelu", "gelu"), "qwen2_5_vl": ("silu",)}
# The rope keys M-RoPE adds to a Qwen2 language model's: they are this file's, not kvyard.model_config's.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenPreprocess:
    """preprocessor_config.json of Qwen2VLImageProcessor: resize to multiples of patch·merge pixels within
    [min_pixels, max_pixels] (aspect kept), rescale, normalise, cut into patches."""
    min_pixels: int
    max_pixels: int
    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int                  # PIL resampling filter (3: bicubic)


@dataclass(frozen=True)
class QwenVisionConfig:
    family: str                    # "qwen2_vl" (LayerNorm/GELU blocks) or "qwen2_5_vl" (RMSNorm/SwiGLU, windows)
    image_token_id: int            # <|image_pad|>: an image's run of them, between vision_start and vision_end
    vision_start_token_id: int
    vision_end_token_id: int
    hidden_size: int               # the tower's width
    intermediate_size: int         # its MLP width
    num_layers: int
    num_heads: int
    hidden_act: str                # "silu" (2.5) or "quick_gelu" / "gelu" (2)
    out_hidden_size: int           # the language model's width (the merger's output)
    patch_size: int                # 14
    temporal_patch_size: int       # 2: a still image is the same frame twice
    merge_size: int                # 2: a 2×2 block of patches is one token
    window_size: int               # 2.5: window attention over window_size² pixels; 0: none (2)
    full_attention_layers: tuple[int, ...]  # 2.5: layers that attend over the whole image
    preprocess: QwenPreprocess

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) patches of an image of this size after the resize."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.preprocess.min_pixels,
                            self.preprocess.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        t, h, w = self.grid(width, height)
        return t * h * w // self.merge_size ** 2

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """<|vision_start|><|image_pad|><|vision_end|>: one image, before the frontend expands its pad token."""
        return self.vision_start_token_id, self.image_token_id, self.vision_end_token_id


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen2-VL's processor resizes to: each a multiple of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as near as rounding allows. ValueError for an image
    more than 200 times longer than wide."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a {width}x{height} image is more than 200 times longer than wide (its aspect ratio "
                         "must be at most 200)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def load_qwen_vision(path: Path, cfg: dict[str, Any]) -> QwenVisionConfig:
    family = cfg["model_type"]
    v = cfg.get("vision_config") or {}
    act = v.get("hidden_act", "silu" if family == "qwen2_5_vl" else "quick_gelu")
    if act not in _TOWER_ACTS[family]:
        raise ModelFileError(f"{path}: vision hidden_act {act!r} is not supported ({', '.join(_TOWER_ACTS[family])})")
    tokens = {}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = cfg.get(key, (cfg.get("text_config") or {}).get(key))
        if not isinstance(value, int):
            raise ModelFileError(f"{path}: config.json names no {key}")
        tokens[key] = value
    if family == "qwen2_5_vl":
        width, inter = int(v.get("hidden_size", 1280)), int(v.get("intermediate_size", 3420))
        out, window = int(v.get("out_hidden_size", 3584)), int(v.get("window_size", 112))
        full = tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
    else:  # Qwen2-VL: embed_dim is the tower's width, hidden_size the language model's
        width = int(v.get("embed_dim", 1280))
        inter, out, window, full = int(width * v.get("mlp_ratio", 4)), int(v.get("hidden_size", 3584)), 0, ()
    heads, depth = int(v.get("num_heads", 16)), int(v.get("depth", 32))
    if width % heads or (width // heads) % 4:
        raise ModelFileError(f"{path}: a vision width of {width} over {heads} heads is not supported")
    patch, merge = int(v.get("patch_size", 14)), int(v.get("spatial_merge_size", 2))
    if window and window % (patch * merge):
        raise ModelFileError(f"{path}: vision window_size {window} is not a multiple of {patch * merge}")
    if int(v.get("in_channels", v.get("in_chans", 3))) != 3:
        raise ModelFileError(f"{path}: a vision tower over {v.get('in_channels')} channels is not supported")
    return QwenVisionConfig(
        family=family, **tokens, hidden_size=width, intermediate_size=inter, num_layers=depth, num_heads=heads,
        hidden_act=act, out_hidden_size=out, patch_size=patch, temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        merge_size=merge, window_size=window, full_attention_layers=full,
        preprocess=_preprocess(path, patch, merge))


def _preprocess(path: Path, patch: int, merge: int) -> QwenPreprocess:
    file = path / "preprocessor_config.json"
    if not file.is_file():
        raise ModelFileError(f"{path}: a vision model needs preprocessor_config.json")
    p: dict[str, Any] = json.loads(file.read_text())
    for key, ours in (("patch_size", patch), ("merge_size", merge)):
        if key in p and int(p[key]) != ours:
            raise ModelFileError(f"{path}: preprocessor {key} {p[key]} differs from the tower's {ours}")
    if not p.get("do_resize", True):
        raise ModelFileError(f"{path}: preprocessing without a resize is not supported")
    size = p.get("size") or {}
    low = int(p.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    high = int(p.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    if not 0 < low <= high:
        raise ModelFileError(f"{path}: min_pixels {low} / max_pixels {high} are not a range")
    norm = p.get("do_normalize", True)
    return QwenPreprocess(
        min_pixels=low, max_pixels=high,
        rescale=float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else 1.0,
        mean=tuple(p.get("image_mean", CLIP_MEAN)) if norm else (0.0, 0.0, 0.0),  # type: ignore[arg-type]
        std=tuple(p.get("image_std", CLIP_STD)) if norm else (1.0, 1.0, 1.0),  # type: ignore[arg-type]
        resample=int(p.get("resample", 3)))


def qwen_text_config(path: Path, cfg: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The language model's config.json part as a plain Qwen2's (transformers 5 writes it as text_config,
    the published checkpoints at the top level) and its M-RoPE sections (frequencies per t, h, w axis)."""
    text = dict(cfg.get("text_config") or cfg)
    text["model_type"] = "qwen2"
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    section: Any = None
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if not isinstance(rope, dict):
            continue
        rope = dict(rope)
        section = rope.pop("mrope_section", section)
        if rope.pop("mrope_interleaved", False):
            raise ModelFileError(f"{path}: interleaved M-RoPE is not supported")
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":  # transformers 4's spelling of default
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope
    if section is None:
        section = (16, 24, 24)  # transformers' default for a config that names none
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelFileError(f"{path}: mrope_section {section!r} must be three sizes summing to {head_dim // 2}")
    return text, tuple(int(s) for s in section)
