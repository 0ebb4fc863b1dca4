"""A tiny random LLaVA-style checkpoint (CLIP vision tower + 2-layer MLP projector + Llama), saved the way
transformers saves LlavaForConditionalGeneration, with a CLIP preprocessor_config.json and an `<image>`
token in the tokenizer. The transformers model is the reference."""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backend.image_tower import ImageTower
from backend.model import LlamaModel
from backend.vision_tower import load_vision_tower
from backend.weights import load_weights
from kvyard.model_config import ModelConfig, load_model_config
from renderers.llama3 import LLAMA3_TEMPLATE
from tests.support.tiny_models import randomize
from tests.support.tiny_tokenizers import LLAMA3_SPECIALS, TokenizerSpec, byte_level_tokenizer, save_hf_tokenizer

IMAGE_TOKEN = "<image>"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# A Llama 3 template whose user content may be a list of parts: an image part becomes `<image>` (as LLaVA's
# chat templates write it).
LLAVA_TEMPLATE = LLAMA3_TEMPLATE


@dataclass
class TinyLlava:
    hf_model: Any                 # transformers' LlavaForConditionalGeneration (float32, eval)
    tokenizer: TokenizerSpec
    image_size: int               # the tower's input side (pixels)
    image_tokens: int             # placeholder tokens per image

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.id(IMAGE_TOKEN)


def tiny_llava(*, image_size: int = 56, patch: int = 14, seed: int = 0, text: dict[str, int] | None = None,
               vision: dict[str, int] | None = None) -> TinyLlava:
    """text / vision: LlamaConfig / CLIPVisionConfig sizes instead of the tiny defaults (benchmarks/vision.py)."""
    import transformers

    spec = byte_level_tokenizer("llama-bpe", specials=(*LLAMA3_SPECIALS, IMAGE_TOKEN))
    spec.specials = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "eot": "<|eot_id|>", "eom": "<|eom_id|>"}
    text_config = transformers.LlamaConfig(**{
        "vocab_size": len(spec.tokens), "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        **(text or {})})
    vision_config = transformers.CLIPVisionConfig(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 2,
        "image_size": image_size, "patch_size": patch, "projection_dim": 64, **(vision or {})})
    config = transformers.LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_id=spec.id(IMAGE_TOKEN),
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).float()
    randomize(model, bias=0.1, norms=("norm.weight", "layer_norm1.weight", "layer_norm2.weight"))
    model.eval()
    return TinyLlava(model, spec, image_size, (image_size // patch) ** 2)


def save_llava_dir(tiny: TinyLlava, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tiny.hf_model.save_pretrained(str(path))
    save_hf_tokenizer(tiny.tokenizer, path, LLAVA_TEMPLATE)
    side = tiny.image_size
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": side},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": side, "width": side},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "do_convert_rgb": True}))
    stops = [tiny.tokenizer.id(t) for k, t in tiny.tokenizer.specials.items() if k in ("eos", "eot", "eom")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(set(stops))}))
    return path


def load_vision_model(path: Path) -> tuple[ModelConfig, LlamaModel, ImageTower]:
    """A vision checkpoint as the backend loads it (float32, CPU): its config, language model and tower."""
    config = load_model_config(path)
    cpu = torch.device("cpu")
    model = LlamaModel(config, load_weights(path, config, torch.float32, cpu, progress=False))
    return config, model, load_vision_tower(path, config, torch.float32, cpu)


def png_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A random RGB picture, encoded."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def reference_greedy(tiny: TinyLlava, path: Path, ids: list[int], image: bytes, steps: int) -> list[int]:
    """transformers' greedy continuation of `ids` with `image` (its CLIP image processor on our decode)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from backend.image_preprocess import decode_image
    processor: Any = CLIPImageProcessorPil.from_pretrained(str(path))
    pixel_values = processor(images=[decode_image(image)], return_tensors="pt")["pixel_values"]
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = tiny.hf_model(input_ids=torch.tensor([ids + out]), pixel_values=pixel_values).logits
            out.append(int(logits[0, -1].argmax()))
    return out
