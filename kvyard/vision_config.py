"""A vision-language checkpoint's image side, read once from config.json and preprocessor_config.json: what
the backend's tower needs (widths, layers, which layer's features) and what the frontend needs (the image
token, how many placeholders an image takes). LLaVA-style here (CLIP tower + 2-layer MLP projector);
Qwen2-VL / Qwen2.5-VL in kvyard/qwen_vl_config.py, whose QwenVisionConfig answers the same questions."""
from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvyard.model_path import ModelFileError
from kvyard.qwen_vl_config import QWEN_VL_MODEL_TYPES, QwenVisionConfig, load_qwen_vision

VISION_MODEL_TYPES = ("llava", *QWEN_VL_MODEL_TYPES)
_TOWER_ACTS = ("quick_gelu", "gelu")
_PROJECTOR_ACTS = ("gelu",)


@dataclass(frozen=True)
class ImagePreprocess:
    """CLIP-style preprocessing (preprocessor_config.json): RGB, resize, center crop, rescale, normalise."""
    shortest_edge: int | None      # resize so the shorter side is this (aspect kept); None: to (height, width)
    resize_to: tuple[int, int]     # (height, width) when shortest_edge is None
    crop: tuple[int, int] | None   # (height, width) center crop; None: no crop
    rescale: float                 # pixel values times this (1/255)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int                  # PIL resampling filter (3: bicubic)


@dataclass(frozen=True)
class VisionConfig:
    image_token_id: int            # the placeholder token; each image stands for num_image_tokens of them
    image_size: int                # the tower's input side, pixels
    patch_size: int
    hidden_size: int               # the tower's width
    intermediate_size: int
    num_layers: int                # layers run: up to the feature layer (the rest are never used)
    num_heads: int
    layer_norm_eps: float
    hidden_act: str                # "quick_gelu" or "gelu"
    keep_cls: bool                 # "full" feature strategy: the class token is an image token too
    preprocess: ImagePreprocess

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        return self.num_patches + (1 if self.keep_cls else 0)

    def num_tokens(self, width: int, height: int) -> int:
        """Placeholders an image of this size takes: every image is resized to the tower's one size."""
        return self.num_image_tokens

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The tokens a prompt writes for one image, before the frontend expands its image token."""
        return (self.image_token_id,)


# A vision-language model's image side, whichever family.
ImageSide = VisionConfig | QwenVisionConfig


def image_spans(token_ids: Sequence[int], vision: ImageSide) -> list[tuple[int, int]]:
    """(start, length) of each image's placeholder run, in prompt order. LLaVA: adjacent images are one
    run cut every num_image_tokens; Qwen-VL: each image's run is its own (vision_start and vision_end
    around it), as long as its size makes it. ValueError when a LLaVA run is not a whole number of images."""
    if isinstance(vision, VisionConfig):
        n = vision.num_image_tokens
        return [(s, n) for s in image_starts(token_ids, vision.image_token_id, n)]
    spans: list[tuple[int, int]] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != vision.image_token_id:
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == vision.image_token_id:
            j += 1
        spans.append((i, j - i))
        i = j
    return spans


def image_starts(token_ids: Sequence[int], image_token_id: int, per_image: int) -> list[int]:
    """Where each image's placeholder run starts, in prompt order (adjacent images: one run cut every
    `per_image` tokens). ValueError when a run is not a whole number of images."""
    starts: list[int] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == image_token_id:
            j += 1
        if (j - i) % per_image:
            raise ValueError(f"{j - i} image placeholder tokens at position {i}: not a multiple of {per_image} "
                             "(one image's placeholders)")
        starts.extend(range(i, j, per_image))
        i = j
    return starts


def load_vision_config(path: Path) -> ImageSide | None:
    """None for a text-only checkpoint (a GGUF, or a config.json of a text model)."""
    if not (path / "config.json").is_file():
        return None
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") not in VISION_MODEL_TYPES:
        return None
    if cfg["model_type"] in QWEN_VL_MODEL_TYPES:
        return load_qwen_vision(path, cfg)
    v = cfg.get("vision_config") or {}
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelFileError(f"{path}: vision tower {v.get('model_type')!r} is not supported (only clip_vision_model)")
    act = v.get("hidden_act", "quick_gelu")
    if act not in _TOWER_ACTS:
        raise ModelFileError(f"{path}: vision hidden_act {act!r} is not supported ({', '.join(_TOWER_ACTS)})")
    if cfg.get("projector_hidden_act", "gelu") not in _PROJECTOR_ACTS:
        raise ModelFileError(f"{path}: projector_hidden_act {cfg.get('projector_hidden_act')!r} is not supported")
    if cfg.get("multimodal_projector_bias", True) is not True:
        raise ModelFileError(f"{path}: a projector without bias is not supported")
    layers = int(v.get("num_hidden_layers", 24))
    feature = cfg.get("vision_feature_layer", -2)
    if not isinstance(feature, int) or not -layers - 1 <= feature <= layers:
        raise ModelFileError(f"{path}: vision_feature_layer {feature!r} is not supported (one layer index)")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelFileError(f"{path}: vision_feature_select_strategy {strategy!r} is not supported")
    token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if not isinstance(token, int):
        raise ModelFileError(f"{path}: config.json names no image_token_index")
    image_size, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 32))
    return VisionConfig(
        image_token_id=token, image_size=image_size, patch_size=patch, hidden_size=int(v.get("hidden_size", 768)),
        intermediate_size=int(v.get("intermediate_size", 3072)),
        num_layers=feature if feature >= 0 else layers + 1 + feature, num_heads=int(v.get("num_attention_heads", 12)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)), hidden_act=act, keep_cls=strategy == "full",
        preprocess=_preprocess(path, image_size))


def _preprocess(path: Path, image_size: int) -> ImagePreprocess:
    file = path / "preprocessor_config.json"
    if not file.is_file():
        raise ModelFileError(f"{path}: a vision model needs preprocessor_config.json")
    p: dict[str, Any] = json.loads(file.read_text())
    if not p.get("do_resize", True):
        raise ModelFileError(f"{path}: preprocessing without a resize is not supported")
    size = p.get("size", {"shortest_edge": image_size})
    if isinstance(size, int):
        size = {"shortest_edge": size}
    if not ("shortest_edge" in size or {"height", "width"} <= set(size)):
        raise ModelFileError(f"{path}: preprocessor size {size!r} is not supported")
    crop = p.get("crop_size", {"height": image_size, "width": image_size}) if p.get("do_center_crop", True) else None
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    out_h, out_w = (crop["height"], crop["width"]) if crop else (size.get("height"), size.get("width"))
    if (out_h, out_w) != (image_size, image_size):
        raise ModelFileError(f"{path}: preprocessing gives {out_h}x{out_w} pixels; the tower takes {image_size}x{image_size}")
    mean = tuple(p.get("image_mean", (0.5, 0.5, 0.5))) if p.get("do_normalize", True) else (0.0, 0.0, 0.0)
    std = tuple(p.get("image_std", (0.5, 0.5, 0.5))) if p.get("do_normalize", True) else (1.0, 1.0, 1.0)
    return ImagePreprocess(
        shortest_edge=size.get("shortest_edge"), resize_to=(size.get("height", 0), size.get("width", 0)),
        crop=(crop["height"], crop["width"]) if crop else None,
        rescale=float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else 1.0,
        mean=mean, std=std, resample=int(p.get("resample", 3)))  # type: ignore[arg-type]
