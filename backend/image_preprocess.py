"""Image bytes → the tower's pixel tensor, as the checkpoint's preprocessor_config.json says (CLIP's steps:
RGB, resize the shorter side, center crop, rescale, normalise), with Pillow. Runs at the gRPC edge, off the
engine thread; a picture Pillow cannot read is the request's error."""
from __future__ import annotations

import hashlib
import io

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from backend.engine_types import ImageInput
from kvyard.errors import ErrorCode, RequestError
from kvyard.vision_config import ImagePreprocess, VisionConfig

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
    x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1)  # [3, H, W]
    x = x * p.rescale
    mean = torch.tensor(p.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(p.std, dtype=torch.float32)[:, None, None]
    return (x - mean) / std


def prompt_images(files: list[bytes], vision: VisionConfig | None) -> list[ImageInput]:
    """A request's image files → the engine's ImageInputs (decoded and preprocessed here, at the gRPC edge,
    in a worker thread: the engine thread only runs the tower)."""
    if not files:
        return []
    if vision is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "this model takes no images (a text-only model)", "images")
    return [ImageInput(hashlib.sha256(data).digest(), pixels(decode_image(data, f"images[{i}]"), vision.preprocess))
            for i, data in enumerate(files)]
