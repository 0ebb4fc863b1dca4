"""A tiny random Qwen2.5-VL or Qwen2-VL checkpoint (dynamic-resolution tower + 2×2 merger + Qwen2 language
model with M-RoPE), saved as transformers saves it (or as the published checkpoints lay it out: flat
config.json, `visual.*` and `model.layers.*` tensors), with a small Qwen2-VL preprocessor_config.json and a
ChatML tokenizer holding the vision tokens. The transformers model is the reference."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support.tiny_models import randomize
from tests.support.tiny_tokenizers import QWEN2_SPECIALS, TokenizerSpec, byte_level_tokenizer, save_hf_tokenizer

VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64  # a few to 64 image tokens: tiny pictures stay tiny
# A ChatML template whose user content may be text or a list of parts, an image part written as Qwen2-VL's
# templates write it.
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class TinyQwenVL:
    hf_model: Any                 # transformers' Qwen2_5_VL / Qwen2VL ForConditionalGeneration (float32, eval)
    tokenizer: TokenizerSpec
    family: str                   # "qwen2_5_vl" or "qwen2_vl"

    def id(self, token: str) -> int:
        return self.tokenizer.id(token)


def tiny_qwen_vl(family: str = "qwen2_5_vl", seed: int = 0, text: dict[str, Any] | None = None,
                 vision: dict[str, Any] | None = None) -> TinyQwenVL:
    """text / vision: text-config / vision-config sizes instead of the tiny defaults (benchmarks/vision.py)."""
    import transformers

    spec = byte_level_tokenizer("qwen2", specials=(*QWEN2_SPECIALS, *VISION_SPECIALS))
    spec.specials = {"eos": "<|im_end|>"}
    text = {**{"vocab_size": len(spec.tokens), "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            "bos_token_id": None, "eos_token_id": spec.id("<|im_end|>")}, **(text or {})}
    ids = {"image_token_id": spec.id("<|image_pad|>"), "video_token_id": spec.id("<|video_pad|>"),
           "vision_start_token_id": spec.id("<|vision_start|>"), "vision_end_token_id": spec.id("<|vision_end|>")}
    if family == "qwen2_5_vl":
        # window_size 56: windows of 2×2 merged tokens, so a 6×10-patch image has six, some cut at the edge
        tower = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 256,
                 "window_size": 56, "fullatt_block_indexes": [1, 3], **(vision or {})}
        config: Any = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=tower, **ids)
        cls: Any = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        tower = {"depth": 3, "embed_dim": 64, "mlp_ratio": 2, "num_heads": 2, "hidden_size": 256, **(vision or {})}
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=tower, **ids)
        cls = transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).float()
    randomize(model, bias=0.1, norms=("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))
    model.eval()
    return TinyQwenVL(model, spec, family)


def save_qwen_vl_dir(tiny: TinyQwenVL, path: Path, *, published_layout: bool = False,
                     max_pixels: int = MAX_PIXELS) -> Path:
    """published_layout: config.json and tensor names as the Hugging Face hub's Qwen2-VL checkpoints have
    them (transformers 4): the language model's keys at the top level, rope_scaling of type mrope."""
    path.mkdir(parents=True, exist_ok=True)
    tiny.hf_model.save_pretrained(str(path))
    if published_layout:
        from safetensors.torch import load_file, save_file
        cfg = json.loads((path / "config.json").read_text())
        text = cfg.pop("text_config")
        params = text.pop("rope_parameters")
        text["rope_theta"] = params.pop("rope_theta")
        text["rope_scaling"] = {"type": "mrope", "mrope_section": params["mrope_section"]}
        text.pop("model_type")
        (path / "config.json").write_text(json.dumps({**text, **cfg}))
        weights = load_file(str(path / "model.safetensors"))
        renamed = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
                   for k, v in weights.items()}
        save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_hf_tokenizer(tiny.tokenizer, path, QWEN_VL_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": MIN_PIXELS, "max_pixels": max_pixels,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True, "resample": 3}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tiny.id("<|im_end|>")]}))
    return path
