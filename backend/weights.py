"""Checkpoint → tensors named the way backend/model.py wants them (GGUF or safetensors)."""
from __future__ import annotations

import ctypes
import gc
import logging
import time
from pathlib import Path

import numpy as np
import torch

from backend.quant import QuantWeight, from_gguf_blocks
from kvyard.model_config import ModelConfig
from kvyard.model_path import ModelFileError, is_gguf

log = logging.getLogger("kvyard.weights")

# Our tensor names: embed, norm, lm_head (absent when tied), and per layer i:
# layers.{i}.attn_norm, .qkv (+ .qkv_bias), .o, .ffn_norm, .gate_up, .down — all [out, in].
# With keep_blocks, GGUF matrices stored as Q4_1 or Q8_0 stay in those blocks (QuantWeight): the
# C++ kernels compute on them directly, and no float32 copy of the model is ever made.
KEPT_BLOCK_TYPES = ("q4_1", "q8_0")
Tensor = torch.Tensor | QuantWeight


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 keep_blocks: bool = False, block_layout: str = "rows") -> dict[str, Tensor]:
    """block_layout: how kept blocks are laid out, "rows" (float32-activation kernels) or "n16" (the
    int16-activation kernels; matrices whose row count is no multiple of 16 stay "rows")."""
    start = time.monotonic()
    raw = _read_gguf(path, config, keep_blocks) if is_gguf(path) else _read_safetensors(path)
    weights = _fuse(raw, config)
    out: dict[str, Tensor] = {name: _placed(t, dtype, device, block_layout) for name, t in weights.items()}
    del raw, weights
    _give_back_freed_memory()
    n_bytes = sum(t.nbytes() if isinstance(t, QuantWeight) else t.numel() * t.element_size() for t in out.values())
    kept = sum(isinstance(t, QuantWeight) for t in out.values())
    log.info("loaded %d tensors (%.0f MB; %d kept in GGUF blocks) from %s in %.1f s as %s on %s",
             len(out), n_bytes / 2**20, kept, path, time.monotonic() - start, dtype, device)
    return out


def _placed(t: Tensor, dtype: torch.dtype, device: torch.device, block_layout: str) -> Tensor:
    if not isinstance(t, QuantWeight):
        return t.to(device=device, dtype=dtype).contiguous()
    return t.to_n16() if block_layout == "n16" and t.shape[0] % 16 == 0 else t


def _give_back_freed_memory() -> None:
    """Loading frees ~1.5x the weights in temporaries (GGUF blocks repacked, q/k/v and gate/up stacked);
    glibc keeps freed heap pages resident until trimmed. Without this the process stays ~45 MB larger."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's rows so RoPE pairs (2i, 2i+1)
    are adjacent; our RoPE pairs (i, i + d/2) like the Hugging Face layout."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)


_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}


def _read_gguf(path: Path, config: ModelConfig, keep_blocks: bool) -> dict[str, Tensor]:
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    raw: dict[str, Tensor] = {}
    tensors = reader.tensors
    for i, tensor in enumerate(tensors):
        parts = tensor.name.split(".")  # e.g. blk.3.attn_q.weight / token_embd.weight
        heads = 0  # q and k rows are interleaved per head by llama.cpp's converter
        if parts[0] == "blk":
            kind = _GGUF_LAYER_NAMES.get(parts[2])
            if kind is None:
                raise ModelFileError(f"{path}: unexpected tensor {tensor.name}")
            heads = {"q": config.num_heads, "k": config.num_kv_heads}.get(kind, 0)
            name = f"layers.{parts[1]}.{kind}" + ("_bias" if parts[-1] == "bias" else "")
        else:
            name = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}.get(parts[0], "")
            if not name:
                continue  # e.g. rope_freqs: not used by the architectures we accept
        block_type = tensor.tensor_type.name.lower()
        if keep_blocks and block_type in KEPT_BLOCK_TYPES and len(tensor.shape) == 2:
            k, n = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF lists the fastest axis first
            weight = from_gguf_blocks(block_type, tensor.data, n, k)
            if heads:
                order = _unpermute_rope(np.arange(n)[:, None], heads)[:, 0]
                weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
            raw[name] = weight
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if heads:
                data = _unpermute_rope(data, heads)
            raw[name] = torch.from_numpy(np.array(data, dtype=np.float32))  # owned copy, not the mmap
        if (i + 1) % 50 == 0 or i + 1 == len(tensors):
            log.info("dequantizing GGUF tensors: %d/%d", i + 1, len(tensors))
    return raw


_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.o_proj.weight": "o",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in load_file(str(file)).items():
            key = key.removeprefix("model.")
            if key.startswith("layers."):
                _, idx, rest = key.split(".", 2)
                if rest in _HF_LAYER_NAMES:
                    raw[f"layers.{idx}.{_HF_LAYER_NAMES[rest]}"] = tensor.float()
            elif key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
                raw[{"embed_tokens.weight": "embed", "norm.weight": "norm",
                     "lm_head.weight": "lm_head"}[key]] = tensor.float()
        log.info("read %s", file.name)
    return raw


def _cat(parts: list[Tensor]) -> Tensor:
    """Stack along the output rows; blocks stay blocks when every part has the same block type."""
    if all(isinstance(p, QuantWeight) for p in parts) and len({p.kind for p in parts}) == 1:  # type: ignore[union-attr]
        return QuantWeight.cat(parts)  # type: ignore[arg-type]
    return torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts], dim=0)


def _fuse(raw: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Fuse q/k/v and gate/up so each layer does two big matmuls instead of five small ones."""
    out = {"embed": raw["embed"], "norm": raw["norm"]}
    if "lm_head" in raw and not config.tie_word_embeddings:
        out["lm_head"] = raw["lm_head"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        try:
            out[p + "attn_norm"] = raw[p + "attn_norm"]
            out[p + "ffn_norm"] = raw[p + "ffn_norm"]
            out[p + "qkv"] = _cat([raw[p + "q"], raw[p + "k"], raw[p + "v"]])
            out[p + "o"] = raw[p + "o"]
            out[p + "gate_up"] = _cat([raw[p + "gate"], raw[p + "up"]])
            out[p + "down"] = raw[p + "down"]
        except KeyError as exc:
            raise ModelFileError(f"checkpoint lacks tensor for {exc.args[0]}") from exc
        if config.attention_bias:
            out[p + "qkv_bias"] = torch.cat([raw[p + "q_bias"], raw[p + "k_bias"], raw[p + "v_bias"]])  # type: ignore[list-item]
    return out
