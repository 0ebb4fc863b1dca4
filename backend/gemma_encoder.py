"""EmbeddingGemma's encoder: Gemma 3's text layers attending both ways (`use_bidirectional_attention`), token
ids → the final-normed hidden states, for the pooling engine (backend/pooling_engine.py) as backend/encoder.py's
models are; sentence-transformers' mean pooling, Dense modules and Normalize follow in backend/pooling.py.
From a Hugging Face directory or llama.cpp's `gemma-embedding` GGUF (its norms stored as 1 + w, its Dense
matrices as `dense_2` / `dense_3`: kvyard/pooling_model.py).

Per layer: RMSNorm (scaled by 1 + w, in float32) before and after attention and before and after the GeGLU
feed-forward; q and k heads RMS-normed, then rotary positions (NeoX halves) at a base per layer kind; grouped
key/value heads; scores scaled by query_pre_attn_scalar^-1/2; sliding layers see keys within
`sliding_window / 2` positions either side, full layers the whole sequence. Embeddings scaled by sqrt(D).
Sequences packed, no padding; attention per sequence (SDPA: the C++ encoder kernel takes neither grouped heads
nor Gemma's head size)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backend.checkpoint import read_gguf_floats
from backend.st_dense import dense_bytes, load_dense
from kvyard.gguf_meta import read_gguf_index
from kvyard.model_path import ModelFileError, is_gguf
from kvyard.pooling_model import PoolingSpec


@dataclass(frozen=True)
class GemmaEncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scaling: float                 # query_pre_attn_scalar ** -0.5
    sliding: tuple[int, ...]       # layers attending within `window`
    window: int                    # |query - key| <= window (the checkpoint's sliding_window // 2)
    rope_theta: float              # full layers' base
    local_rope_theta: float        # sliding layers' base
    type_vocab_size: int = 1       # no segments

    @classmethod
    def from_gguf(cls, path: Path) -> GemmaEncoderConfig:
        """llama.cpp's keys: the sliding layers from `attention.sliding_window_pattern` (a flag per layer, or n:
        every n-th layer full, the others sliding; 6 when absent, as llama.cpp reads it), its window symmetric
        (`sliding_window / 2` either side), scores scaled by key_length^-1/2 as llama.cpp scales them."""
        index = read_gguf_index(path)
        meta, a = index.meta, "gemma-embedding"
        try:
            n, heads = int(meta[f"{a}.block_count"]), int(meta[f"{a}.attention.head_count"])
            hidden = int(meta[f"{a}.embedding_length"])
            head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // heads)
            pattern = meta.get(f"{a}.attention.sliding_window_pattern", 6)
            flags = [bool(f) for f in pattern] if isinstance(pattern, list) else \
                [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n)]
            return cls(vocab_size=index.tensors["token_embd.weight"].shape[0], hidden_size=hidden, num_layers=n,
                       num_heads=heads, num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv") or heads),
                       head_dim=head_dim, eps=float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
                       scaling=head_dim ** -0.5, sliding=tuple(i for i, f in enumerate(flags) if f),
                       window=int(meta[f"{a}.attention.sliding_window"]) // 2,
                       rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
                       local_rope_theta=float(meta.get(f"{a}.rope.freq_base_swa", 10000.0)))
        except KeyError as exc:
            raise ModelFileError(f"{path}: GGUF lacks {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: Path) -> GemmaEncoderConfig:
        """transformers 4.5x's keys (rope_theta, rope_local_base_freq) or 5's (rope_parameters per layer type)."""
        cfg = json.loads((path / "config.json").read_text())
        n, rope = int(cfg["num_hidden_layers"]), cfg.get("rope_parameters") or {}
        every = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        kinds = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        heads = int(cfg["num_attention_heads"])
        return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]), num_layers=n, num_heads=heads,
                   num_kv_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=int(cfg.get("head_dim", 256)),
                   eps=float(cfg.get("rms_norm_eps", 1e-6)), scaling=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                   sliding=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
                   window=int(cfg.get("sliding_window", 512)) // 2,
                   rope_theta=float((rope.get("full_attention") or {}).get("rope_theta") or cfg.get("rope_theta") or 1e6),
                   local_rope_theta=float((rope.get("sliding_attention") or {}).get("rope_theta")
                                          or cfg.get("rope_local_base_freq") or 10000.0))


class GemmaEncoderModel:
    """Plain functions over a dict of tensors (as backend/encoder.py's EncoderModel); an EMBED model only."""

    def __init__(self, spec: PoolingSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec, self.dtype, self.device = spec, dtype, device
        gguf_file = is_gguf(spec.path)
        self.cfg = (GemmaEncoderConfig.from_gguf if gguf_file else GemmaEncoderConfig.from_dir)(spec.path)
        self.w = (_load_gguf if gguf_file else _load)(spec.path, self.cfg, dtype, device)
        self.dense = load_dense(spec.dense, dtype, device)
        d = self.cfg.head_dim
        self._inv_freq = [1.0 / theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
                          for theta in (self.cfg.rope_theta, self.cfg.local_rope_theta)]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values()) + dense_bytes(self.dense)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, type_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, T], mask [B, T] bool (padding on the right; type_ids unused) → [B, T, D], zeros at padding."""
        B, T = ids.shape
        real = mask.reshape(-1).nonzero().squeeze(1)
        positions = torch.arange(T, device=ids.device).repeat(B)[real]
        x = self.packed(ids.reshape(-1)[real], positions, mask.sum(dim=1).tolist())
        out = x.new_zeros((B * T, x.shape[-1]))
        out[real] = x
        return out.view(B, T, -1)

    def packed(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Sequences one after another (positions from 0 in each, lengths summing to N) → [N, D]."""
        w, cfg = self.w, self.cfg
        H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = w["embed"][ids] * torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype)
        rotary = [self._rotary(positions, f) for f in self._inv_freq]  # [full, sliding]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            local = i in cfg.sliding
            qkv = F.linear(self._norm(x, p + "input_layernorm"), w[p + "qkv"])      # [N, (H + 2K) d]
            q = self._norm(qkv[:, :H * d].view(-1, H, d), p + "q_norm")
            k = self._norm(qkv[:, H * d:(H + K) * d].view(-1, K, d), p + "k_norm")
            v = qkv[:, (H + K) * d:].view(-1, K, d)
            cos, sin = rotary[local]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            a = self._attention(q, k, v, lengths, cfg.window if local else 0)          # [N, H d]
            x = x + self._norm(F.linear(a, w[p + "o"]), p + "post_attention_layernorm")
            gate, up = F.linear(self._norm(x, p + "pre_feedforward_layernorm"), w[p + "gate_up"]).chunk(2, dim=-1)
            h = F.linear(F.gelu(gate, approximate="tanh") * up, w[p + "down"])
            x = x + self._norm(h, p + "post_feedforward_layernorm")
        return self._norm(x, "norm")

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                   window: int) -> torch.Tensor:
        """Each sequence alone, every query seeing every key (within `window` positions when > 0)."""
        out = q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            mask = None
            if window and n > window + 1:
                i = torch.arange(n, device=q.device)
                mask = (i[:, None] - i[None, :]).abs() <= window
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                                               attn_mask=mask, scale=self.cfg.scaling, enable_gqa=True)  # [H, n, d]
            out[rows] = o.transpose(0, 1).reshape(n, -1)
            start += n
        return out

    def _rotary(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]            # [N, d/2]
        return angles.cos().to(self.dtype)[:, None], angles.sin().to(self.dtype)[:, None]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Gemma's RMSNorm: in float32, times the norm's scale (1 + w, held as such in float32), back in the
        model's dtype."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * self.w[name]).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]: RoPE on the two halves of each head (cos, sin [N, 1, d/2])."""
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)


# Our names for a layer's tensors; the norms hold their scale, 1 + w.
_NORMS = ("q_norm", "k_norm", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")
_HF_LAYER = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
             "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm", "mlp.gate_proj": "gate", "mlp.up_proj": "up",
             "mlp.down_proj": "down", **{n: n for n in _NORMS[2:]}}
_GGUF_LAYER = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "attn_q_norm": "q_norm",
               "attn_k_norm": "k_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
               "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def _load(path: Path, cfg: GemmaEncoderConfig, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Gemma3TextModel's safetensors (a `model.` prefix dropped)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            name = name.removeprefix("model.")
            parts = name.removesuffix(".weight").split(".", 2)
            if parts[0] == "layers" and len(parts) == 3 and parts[2] in _HF_LAYER:
                name = f"layers.{parts[1]}.{_HF_LAYER[parts[2]]}"
                t = t.float() + 1.0 if name.endswith(_NORMS) else t
            elif name in ("embed_tokens.weight", "norm.weight"):
                name, t = ("embed", t) if name == "embed_tokens.weight" else ("norm", t.float() + 1.0)
            else:
                raise ModelFileError(f"{path}: tensor {name} is not part of a Gemma 3 encoder this server runs")
            raw[name] = t
    return _assemble(path, raw, cfg, dtype, device)


def _load_gguf(path: Path, cfg: GemmaEncoderConfig, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """llama.cpp's `gemma-embedding` tensors (the norms already 1 + w; dense_2 / dense_3 are the Dense modules',
    read by backend/st_dense.py)."""
    raw: dict[str, torch.Tensor] = {}
    for name, t in read_gguf_floats(path).items():
        parts = name.removesuffix(".weight").split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER:
            raw[f"layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}"] = t
        elif name in ("token_embd.weight", "output_norm.weight"):
            raw["embed" if name == "token_embd.weight" else "norm"] = t
        elif name not in ("dense_2.weight", "dense_3.weight", "output.weight"):  # output: an unused LM head
            raise ModelFileError(f"{path}: tensor {name} is not part of a Gemma 3 encoder this server runs")
    return _assemble(path, raw, cfg, dtype, device)


def _assemble(path: Path, raw: dict[str, torch.Tensor], cfg: GemmaEncoderConfig, dtype: torch.dtype,
              device: torch.device) -> dict[str, torch.Tensor]:
    """q/k/v as one matrix and gate/up as one per layer; the norms' scales kept in float32, the rest in dtype."""
    needed = ["embed", "norm"] + [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in set(_HF_LAYER.values())]
    missing = [n for n in needed if n not in raw]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{path}: weights missing {missing[0]}{more}")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        raw[p + "qkv"] = torch.cat([raw.pop(p + m) for m in "qkv"])
        raw[p + "gate_up"] = torch.cat([raw.pop(p + "gate"), raw.pop(p + "up")])
    return {n: t.to(device=device, dtype=torch.float32 if n == "norm" or n.endswith(_NORMS) else dtype).contiguous()
            for n, t in raw.items()}
