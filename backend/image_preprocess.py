"""Image bytes → the tower's pixel tensor, as the checkpoint's preprocessor_config.json says (CLIP's steps:
RGB, resize the shorter side, center crop, rescale, normalise; Qwen-VL's: resize to multiples of 28 pixels
within its pixel budget, rescale, normalise, cut into patches), with Pillow. Runs at the gRPC edge, off the
engine thread; a picture Pillow cannot read is the request's error. An image whose embedding the tower
already holds is only hashed and its size read from the header (Qwen-VL's grid): no decode, no patches."""
from __future__ import annotations

import hashlib
import io
from collections.abc import Set

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from backend.engine_types import ImageInput
from kvyard.errors import ErrorCode, RequestError
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.vision_config import ImagePreprocess, ImageSide

MAX_IMAGE_PIXELS = 64 << 20  # a decompression bomb's size is an error, not a long resize


def decode_image(data: bytes, what: str = "image") -> Image.Image:
    """The picture in `data`, loaded, as RGB; RequestError (INVALID_ARGUMENT naming `what`) when it is none."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{what}: {img.width}x{img.height} pixels is more "
                                   f"than {MAX_IMAGE_PIXELS} allowed", what)
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{what}: not a readable image ({exc})", what) from None


def pixels(img: Image.Image, p: ImagePreprocess) -> torch.Tensor:
    """[3, H, W] float32, normalised."""
    if p.shortest_edge is not None:
        short, long = sorted((img.width, img.height))
        other = int(p.shortest_edge * long / short)
        size = (p.shortest_edge, other) if img.width <= img.height else (other, p.shortest_edge)
    else:
        size = (p.resize_to[1], p.resize_to[0])
    if size != img.size:
        img = img.resize(size, resample=Image.Resampling(p.resample))
    if p.crop is not None:
        ch, cw = p.crop
        top, left = (img.height - ch) // 2, (img.width - cw) // 2
        img = img.crop((left, top, left + cw, top + ch))
    return _normalise(img, p.rescale, p.mean, p.std)


def _normalise(img: Image.Image, rescale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """[3, H, W] float32: (pixel · rescale - mean) / std per channel."""
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1)  # [3, H, W]
    x = x * rescale
    return (x - torch.tensor(mean, dtype=torch.float32)[:, None, None]) / torch.tensor(std, dtype=torch.float32)[:, None, None]


def qwen_patches(img: Image.Image, v: QwenVisionConfig, grid: tuple[int, int, int]) -> torch.Tensor:
    """Qwen-VL: the image resized to its (t, h, w) grid, normalised and cut into patches [h·w, 3·t·p·p] (in
    2×2 merge blocks, row-major, each patch's frame repeated t times: a still image is a clip of t equal
    frames)."""
    t, gh, gw = grid
    p, m, pre = v.patch_size, v.merge_size, v.preprocess
    if (img.width, img.height) != (gw * p, gh * p):
        img = img.resize((gw * p, gh * p), resample=Image.Resampling(pre.resample))
    x = _normalise(img, pre.rescale, pre.mean, pre.std)                            # [3, gh·p, gw·p]
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, p, p]
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, v.temporal_patch_size, -1, -1)
    return x.reshape(gh * gw, 3 * v.temporal_patch_size * p * p)


def image_size(data: bytes, what: str = "image") -> tuple[int, int]:
    """(width, height) from the file's header alone (nothing decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{what}: not a readable image ({exc})", what) from None


def prompt_images(files: list[bytes], vision: ImageSide | None, cached: Set[bytes] = frozenset()) -> list[ImageInput]:
    """A request's image files → the engine's ImageInputs (decoded and preprocessed here, at the gRPC edge,
    in a worker thread: the engine thread only runs the tower). cached: digests the tower holds (a hint:
    ImageTower.known), whose files are not preprocessed."""
    if not files:
        return []
    if vision is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "this model takes no images (a text-only model)", "images")
    return [image_input(data, vision, f"images[{i}]", cached) for i, data in enumerate(files)]


def image_input(data: bytes, vision: ImageSide, what: str = "image", cached: Set[bytes] = frozenset()) -> ImageInput:
    digest = hashlib.sha256(data).digest()
    if digest in cached:  # the same bytes decoded fine before; M-RoPE needs only the grid, from the size
        grid = _grid(vision, image_size(data, what), what) if isinstance(vision, QwenVisionConfig) else None
        return ImageInput(digest, None, grid=grid, file=data)
    img = decode_image(data, what)
    if isinstance(vision, QwenVisionConfig):
        grid = _grid(vision, img.size, what)
        return ImageInput(digest, qwen_patches(img, vision, grid), grid=grid)
    return ImageInput(digest, pixels(img, vision.preprocess))


def _grid(vision: QwenVisionConfig, size: tuple[int, int], what: str) -> tuple[int, int, int]:
    try:
        return vision.grid(*size)
    except ValueError as exc:  # too long and thin to resize
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"{what}: {exc}", what) from None
