"""sentence-transformers' Dense modules after the pooling (kvyard/st_files.DenseModule): each pooled vector
through activation(x W^T + b) (+ x, or x R^T, with use_residual), in the model's dtype and device. The
pooling models (backend/encoder.py, backend/decoder_pooling.py) load them; backend/pooling.py applies them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backend.checkpoint import read_gguf_floats
from kvyard.model_path import ModelFileError
from kvyard.st_files import DenseModule

_ACTS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
         "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class DenseLayer:
    weight: torch.Tensor              # [out, in]
    bias: torch.Tensor | None         # [out]
    activation: str
    residual: torch.Tensor | None     # use_residual with in != out: [out, in]
    add_input: bool                   # use_residual


def load_dense(modules: tuple[DenseModule, ...], dtype: torch.dtype, device: torch.device) -> list[DenseLayer]:
    layers = []
    for m in modules:
        if m.tensor:
            raw = {"linear.weight": read_gguf_floats(m.weights, {m.tensor}).get(m.tensor)}
        elif m.weights.suffix == ".safetensors":
            raw = load_file(str(m.weights))
        else:
            raw = torch.load(m.weights, map_location="cpu", weights_only=True)
        weight = raw.get("linear.weight")
        if weight is None or tuple(weight.shape) != (m.out_features, m.in_features):
            raise ModelFileError(f"{m.weights}: {m.tensor or 'linear.weight'} is not [{m.out_features}, {m.in_features}]")
        residual = raw.get("residual.weight") if m.residual and m.in_features != m.out_features else None
        if m.residual and m.in_features != m.out_features and residual is None:
            raise ModelFileError(f"{m.weights}: use_residual needs residual.weight")

        def place(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()
        layers.append(DenseLayer(place(weight), place(raw.get("linear.bias")), m.activation,  # type: ignore[arg-type]
                                 place(residual), m.residual))
    return layers


def dense_bytes(layers: list[DenseLayer]) -> int:
    return sum(t.numel() * t.element_size() for layer in layers for t in (layer.weight, layer.bias, layer.residual)
               if t is not None)


def apply_dense(layers: list[DenseLayer], x: torch.Tensor) -> torch.Tensor:
    """x [B, in] → [B, out] through every layer."""
    for layer in layers:
        out = _ACTS[layer.activation](F.linear(x, layer.weight, layer.bias))
        if layer.add_input:
            out = out + (x if layer.residual is None else F.linear(x, layer.residual))
        x = out
    return x
