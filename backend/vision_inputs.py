"""A prompt's images on the engine side: where their placeholder runs are, the block-key salts that make the
prefix cache tell images apart, the embeddings that replace the placeholders' rows in prefill, and (Qwen-VL)
the M-RoPE positions the images give the sequence (backend/mrope.py)."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from backend.engine_types import ImageInput
from backend.mrope import mrope_positions
from backend.sequence import Sequence
from backend.image_tower import ImageTower
from kvyard.block_keys import image_block_salts
from kvyard.errors import ErrorCode, RequestError
from kvyard.qwen_vl_config import QwenVisionConfig
from kvyard.vision_config import ImageSide, image_spans


@dataclass(frozen=True)
class ImageEmbeds:
    """A sequence's feature: each image's first placeholder position and its embeddings [n, D]."""
    spans: tuple[tuple[int, torch.Tensor], ...]


def check_images(prompt_ids: list[int], images: list[ImageInput], vision: ImageSide | None) -> list[tuple[int, int]]:
    """Each image's placeholder run (start, length); RequestError when images and placeholders do not pair up."""
    if vision is None:
        if images:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "this model takes no images (a text-only model)", "images")
        return []
    try:
        spans = image_spans(prompt_ids, vision)
    except ValueError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "token_ids") from None
    if len(spans) != len(images):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the prompt has placeholders for {len(spans)} image(s) "
                           f"but the request carries {len(images)}", "images")
    if isinstance(vision, QwenVisionConfig):  # each run as long as its image's size makes it
        for k, ((start, length), im) in enumerate(zip(spans, images)):
            if im.grid is None:
                raise RequestError(ErrorCode.INTERNAL, "a Qwen-VL image reached the engine without its grid")
            want = im.grid[0] * im.grid[1] * im.grid[2] // vision.merge_size ** 2
            if length != want:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, f"image {k}: {length} placeholder tokens at position "
                                   f"{start}, but the image takes {want}", "token_ids")
    return spans


def attach_images(seqs: Seq[Sequence], images: list[ImageInput], vision: ImageSide | None,
                  tower: ImageTower | None, block_size: int) -> None:
    """Salt the sequences' block keys with the images' digests, give Qwen-VL sequences their M-RoPE
    positions (salt_images) and the images' embeddings: a VIT's (ImageInput.embeds) or, where a tower runs
    (PDFUSION, PREFILL), the tower's (engine thread: the tower's cache is the engine's). A DECODE backend's
    hand-over only salts and positions (salt_images)."""
    if not images or vision is None:
        return
    spans = salt_images(seqs, images, vision, block_size)
    rows = []
    for (start, _), im in zip(spans, images):
        if im.embeds is not None:
            rows.append((start, im.embeds))
        elif tower is None or (im.pixels is None and im.file is None):
            raise RequestError(ErrorCode.INTERNAL, "an image reached the engine with neither embeddings nor "
                               "a tower to run on its pixels")
        else:
            rows.append((start, tower.embed(im.digest, im.pixels, im.grid, im.file)))
    feature = ImageEmbeds(tuple(rows))
    for seq in seqs:
        seq.features = (*seq.features, feature)


def salt_images(seqs: Seq[Sequence], images: list[ImageInput], vision: ImageSide | None,
                block_size: int) -> list[tuple[int, int]]:
    """Mix the images' digests into the keys of the blocks their placeholders fill (both sides of a
    hand-over, so prefix caching tells images apart) and, for Qwen-VL, give the sequences the M-RoPE
    positions the images make (both sides too: decode runs at index + the prompt's delta); returns each
    image's placeholder run (start, length)."""
    if not images or vision is None:
        return []
    spans = check_images(seqs[0].prompt_token_ids, images, vision)
    salts = image_block_salts(spans, [im.digest for im in images], block_size)
    rope = None
    if isinstance(vision, QwenVisionConfig):
        rope = mrope_positions(seqs[0].num_prompt_tokens, spans, [im.grid for im in images if im.grid], vision)
    for seq in seqs:
        seq.block_salts = salts
        if rope is not None:
            seq.features = (*seq.features, rope)
    return spans


def chunk_embeds(seq: object, start: int, n: int) -> list[tuple[int, torch.Tensor]]:
    """The image embedding rows positions [start, start + n) take: (offset in the chunk, rows [m, D])."""
    feature = seq.feature(ImageEmbeds) if isinstance(seq, Sequence) else None
    if feature is None:
        return []
    out = []
    for span_start, rows in feature.spans:
        a, b = max(start, span_start), min(start + n, span_start + rows.shape[0])
        if a < b:
            out.append((a - start, rows[a - span_start:b - span_start]))
    return out
