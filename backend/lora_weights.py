"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) → low-rank matrices laid out
for backend/model.py's fused projections.

The model computes q/k/v as one `qkv` matrix and gate/up as one `gate_up`: an adapter's parts for a fused
matrix are stacked into one A [sum of ranks, in] and a block-diagonal B [fused out, sum of ranks] (zero
rows where a part has no adapter), with the scale (lora_alpha / r) folded into B, so the model adds
`(x @ A^T) @ B^T` beside the base product. B is kept transposed ([sum of ranks, fused out], contiguous):
the fused C++ decode step reads it a rank column at a time. Anything PEFT can save that this does not compute the same way
(rsLoRA, DoRA, trained biases, extra saved modules, per-module rank or alpha patterns, embedding or lm_head
targets) is refused with an AdapterError that names it: never loaded and silently computed differently."""
from __future__ import annotations

import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvyard.model_config import ModelConfig

# PEFT's module name → (our fused matrix, part index within it).
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
# Our fused matrices, in the order of backend/csrc/lora_step.h's LoraTarget.
FUSED_TARGETS = ("qkv", "o", "gate_up", "down")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# Config keys whose non-default values change the arithmetic: (key, its neutral values, why refused).
_REFUSED = (
    ("use_rslora", (False, None), "rank-stabilised LoRA (use_rslora) scales by alpha/sqrt(r)"),
    ("use_dora", (False, None), "DoRA (use_dora) adds a magnitude vector"),
    ("bias", ("none", None), "trained biases (bias != 'none')"),
    ("modules_to_save", (None, []), "fully trained extra modules (modules_to_save)"),
    ("rank_pattern", (None, {}), "per-module ranks (rank_pattern)"),
    ("alpha_pattern", (None, {}), "per-module alphas (alpha_pattern)"),
    ("fan_in_fan_out", (False, None), "transposed (Conv1D) weights (fan_in_fan_out)"),
    ("lora_bias", (False, None), "a bias on lora_B (lora_bias)"),
    ("trainable_token_indices", (None, [], {}), "trained token embeddings (trainable_token_indices)"),
    # PiSSA, OLoRA, CorDA and LoftQ start from a changed base model: saved unconverted, the adapter only
    # answers right over that base (PEFT converts it to a plain LoRA, init_lora_weights true, on request).
    ("init_lora_weights", (True, False, None, "gaussian", "eva", "orthogonal"),
     "an adapter over a changed base model (init_lora_weights PiSSA / OLoRA / CorDA / LoftQ, not converted)"),
)
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: unreadable, malformed, or using a feature not computed here."""


@dataclass
class LoraAdapter:
    """One loaded adapter. Immutable once loaded: sequences that use it hold it, so an unload never pulls
    weights out from under a request in flight."""
    name: str
    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]                 # PEFT module names it adapts, sorted
    # (layer, fused matrix) → (A [R, in], B^T [R, out] × scale); R = the sum of the parts' ranks.
    mats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    uid: int = field(default_factory=lambda: next(LoraAdapter._uids))
    fused: Any = field(default=None, compare=False, repr=False)  # its fused decode step form, made on first use
    _uids: ClassVar[itertools.count] = itertools.count(1)

    @property
    def cache_key(self) -> bytes:
        """Mixed into every block key of its sequences (Sequence.extra_key): two adapters, or two loads of
        one name, never share KV, and none shares the base model's."""
        return f"lora:{self.uid}:{self.name}".encode()

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.mats.values())


def read_adapter_config(path: Path) -> dict[str, Any]:
    """The adapter's config, checked: LoRA, rank and alpha positive, every target one of TARGETS."""
    file = path / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file}: cannot read the adapter's config ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{file}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {cfg.get('peft_type')!r}: only LoRA adapters are served")
    for key, neutral, why in _REFUSED:
        if cfg.get(key) not in neutral:
            raise AdapterError(f"{file}: {why} is not supported; {key} is {cfg.get(key)!r}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{file}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha <= sys.float_info.max:
        raise AdapterError(f"{file}: lora_alpha must be a positive finite number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGETS)
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise AdapterError(f"{file}: target_modules must be a list of module names (from {', '.join(TARGETS)}), "
                           f"got {targets!r}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(f"{file}: target modules {unknown} are not adapted here; LoRA applies to "
                           f"{', '.join(TARGETS)}")
    return {**cfg, "target_modules": sorted(targets), "lora_alpha": alpha}


def load_adapter(name: str, path: Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> LoraAdapter:
    """Reads and checks the adapter against the base model's shapes; raises AdapterError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_adapter_config(path)
    file = path / WEIGHTS_FILE
    try:
        tensors = load_file(str(file))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{file}: cannot read the adapter's weights ({exc})") from None
    r, alpha = cfg["r"], float(cfg["lora_alpha"])
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _TENSOR.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"{file}: tensor {key!r} is not a LoRA A/B matrix of {', '.join(TARGETS)}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if not 0 <= layer < config.num_layers:
            raise AdapterError(f"{file}: {key!r} names layer {layer}; the model has {config.num_layers}")
        if not torch.isfinite(t).all():  # every answer with the adapter would fail at sampling
            raise AdapterError(f"{file}: tensor {key!r} holds NaN or infinite values")
        parts.setdefault((layer, module), {})[ab] = t.to(torch.float32)
    mats = _fuse(parts, config, r, alpha / r, str(file))
    if not mats:
        raise AdapterError(f"{file}: holds no LoRA matrices")
    return LoraAdapter(name, str(path), r, alpha, tuple(cfg["target_modules"]),
                       {k: (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
                        for k, (a, b) in mats.items()})


def _shapes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Our fused matrix → (its input width, its parts' output widths)."""
    d, q, kv, inter = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    return {"qkv": (d, [q, kv, kv]), "o": (q, [d]), "gate_up": (d, [inter, inter]), "down": (inter, [d])}


def _fuse(parts: dict[tuple[int, str], dict[str, torch.Tensor]], config: ModelConfig, r: int, scale: float,
          where: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = _shapes(config)
    fused: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        target, part = TARGETS[module]
        width, outs = shapes[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (r, width) or b.shape != (outs[part], r):
            raise AdapterError(f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} do not fit r={r} on this model ([{r}, {width}] and "
                               f"[{outs[part]}, {r}]); is it an adapter of another base model?")
        fused.setdefault((layer, target), []).append((part, a, b * scale))
    out = {}
    for (layer, target), items in fused.items():
        outs = shapes[target][1]
        starts = [sum(outs[:i]) for i in range(len(outs))]
        big_b = torch.zeros(sum(outs), r * len(items))
        for j, (part, _, b) in enumerate(items):
            big_b[starts[part]:starts[part] + outs[part], j * r:(j + 1) * r] = b
        out[(layer, target)] = (torch.cat([a for _, a, _ in items]), big_b.t())
    return out
