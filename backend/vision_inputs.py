"""A prompt's images on the engine side: where their placeholder runs are, the block-key salts that make the
prefix cache tell images apart, and the embeddings that replace the placeholders' rows in prefill."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from backend.engine_types import ImageInput
from backend.sequence import Sequence
from backend.vision_tower import VisionTower
from kvyard.block_keys import image_block_salts
from kvyard.errors import ErrorCode, RequestError
from kvyard.vision_config import VisionConfig, image_starts


@dataclass(frozen=True)
class ImageEmbeds:
    """A sequence's feature: each image's first placeholder position and its embeddings [n, D]."""
    spans: tuple[tuple[int, torch.Tensor], ...]


def check_images(prompt_ids: list[int], images: list[ImageInput], vision: VisionConfig | None) -> list[int]:
    """Each image's placeholder start; RequestError when images and placeholders do not pair up."""
    if vision is None:
        if images:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "this model takes no images (a text-only model)", "images")
        return []
    try:
        starts = image_starts(prompt_ids, vision.image_token_id, vision.num_image_tokens)
    except ValueError as exc:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "token_ids") from None
    if len(starts) != len(images):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the prompt has placeholders for {len(starts)} image(s) "
                           f"but the request carries {len(images)}", "images")
    return starts


def attach_images(seqs: Seq[Sequence], images: list[ImageInput], vision: VisionConfig | None,
                  tower: VisionTower | None, block_size: int) -> None:
    """Salt the sequences' block keys with the images' digests and give them the images' embeddings: a
    VIT's (ImageInput.embeds) or, where a tower runs (PDFUSION, PREFILL), the tower's (engine thread: the
    tower's cache is the engine's). A DECODE backend's hand-over only salts (salt_images)."""
    if not images or vision is None:
        return
    starts = salt_images(seqs, images, vision, block_size)
    spans = []
    for start, im in zip(starts, images):
        if im.embeds is not None:
            spans.append((start, im.embeds))
        elif tower is None or im.pixels is None:
            raise RequestError(ErrorCode.INTERNAL, "an image reached the engine with neither embeddings nor "
                               "a tower to run on its pixels")
        else:
            spans.append((start, tower.embed(im.digest, im.pixels)))
    feature = ImageEmbeds(tuple(spans))
    for seq in seqs:
        seq.features = (*seq.features, feature)


def salt_images(seqs: Seq[Sequence], images: list[ImageInput], vision: VisionConfig | None,
                block_size: int) -> list[int]:
    """Mix the images' digests into the keys of the blocks their placeholders fill (both sides of a
    hand-over, so prefix caching tells images apart); returns each image's placeholder start."""
    if not images or vision is None:
        return []
    starts = check_images(seqs[0].prompt_token_ids, images, vision)
    salts = image_block_salts(starts, [im.digest for im in images], vision.num_image_tokens, block_size)
    for seq in seqs:
        seq.block_salts = salts
    return starts


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
