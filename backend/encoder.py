"""The encoder model family (BERT, XLM-RoBERTa): token ids → hidden states → the checkpoint's heads.
The pooling engine (backend/pooling_engine.py) runs it one padded batch per step.

Post-LayerNorm transformer blocks with learned absolute positions, read from a Hugging Face safetensors
directory (the prefix `bert.` / `roberta.` of *ForSequenceClassification checkpoints is dropped). Heads:
- classify: BERT's pooler (tanh of a dense layer over [CLS]) and `classifier`; XLM-R's `classifier.dense`
  (tanh) and `classifier.out_proj` over <s>. Logits out; the frontend turns them into probabilities.
- sparse / colbert (BGE-M3, `sparse_linear.pt` / `colbert_linear.pt` beside the weights): relu of a
  linear per token, and a linear per token after the first, L2-normalised."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvyard.model_path import ModelFileError
from kvyard.pooling_model import ModelKind, PoolingSpec

_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int           # D
    num_layers: int
    num_heads: int             # H; head dim d = D / H
    layer_norm_eps: float
    activation: str            # "gelu" (erf), "gelu_new"/"gelu_pytorch_tanh" (tanh approximation), "relu"
    position_offset: int       # first position id: 0 (BERT), pad_token_id + 1 (XLM-R)
    type_vocab_size: int       # segment embeddings (BERT 2, XLM-R 1)

    @classmethod
    def from_dir(cls, path: Path) -> EncoderConfig:
        cfg = json.loads((path / "config.json").read_text())
        xlmr = cfg["model_type"] == "xlm-roberta"
        return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                   activation=str(cfg.get("hidden_act", "gelu")),
                   position_offset=int(cfg.get("pad_token_id", 1)) + 1 if xlmr else 0,
                   type_vocab_size=int(cfg.get("type_vocab_size", 2)))


class EncoderModel:
    """Plain functions over a dict of tensors; no nn.Module (as backend/model.py)."""

    def __init__(self, spec: PoolingSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.cfg = EncoderConfig.from_dir(spec.path)
        self.device = device
        self.dtype = dtype
        self.w = _load(spec.path, dtype, device)
        missing = [n for n in _required(self.cfg, spec) if n not in self.w]
        if missing:
            raise ModelFileError(f"{spec.path}: weights missing {', '.join(missing[:5])}")

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, type_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, type_ids: [B, T] int64; mask: [B, T] bool (True = a real token, padding on the right).
        Returns the last hidden states [B, T, D] (zeros at padding)."""
        w, cfg = self.w, self.cfg
        B, T = ids.shape
        positions = torch.arange(cfg.position_offset, cfg.position_offset + T, device=ids.device)  # [T]
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
        if "embeddings.token_type_embeddings.weight" in w:  # one segment (XLM-R): every token is segment 0
            types = type_ids if cfg.type_vocab_size > 1 else torch.zeros_like(type_ids)
            x = x + w["embeddings.token_type_embeddings.weight"][types]
        D, H = cfg.hidden_size, cfg.num_heads
        d = D // H
        # Padding runs only through attention: every other matmul takes the real tokens alone, packed
        # [N, D] (a batch of 20-60-word sentences is about a third padding).
        real = mask.reshape(-1).nonzero().squeeze(1) if not bool(mask.all()) else None   # [N]
        x = x.reshape(B * T, D) if real is None else x.reshape(B * T, D)[real]
        x = self._norm(x, "embeddings.LayerNorm")                          # [N, D]
        attn_mask = mask[:, None, None, :]                                 # [B, 1, 1, T]
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            qkv = _unpack(F.linear(x, w[p + "qkv.weight"], w[p + "qkv.bias"]), real, B * T)  # [B * T, 3D]
            q, k, v = qkv.view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)       # each [B, H, T, d]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, H, T, d]
            a = a.transpose(1, 2).reshape(B * T, D)
            a = F.linear(a if real is None else a[real], w[p + "attention.output.dense.weight"],
                         w[p + "attention.output.dense.bias"])
            x = self._norm(x + a, p + "attention.output.LayerNorm")
            h = F.linear(x, w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"])
            h = F.linear(self._act(h), w[p + "output.dense.weight"], w[p + "output.dense.bias"])
            x = self._norm(x + h, p + "output.LayerNorm")
        return _unpack(x, real, B * T).view(B, T, D)                     # zeros at padding

    def classify(self, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden: [B, T, D] → logits [B, num_labels], from the first token (ids, mask: unused)."""
        w = self.w
        first = hidden[:, 0]                                                # [B, D]
        if self.spec.model_type == "xlm-roberta":
            h = torch.tanh(F.linear(first, w["classifier.dense.weight"], w["classifier.dense.bias"]))
            return F.linear(h, w["classifier.out_proj.weight"], w["classifier.out_proj.bias"])
        pooled = torch.tanh(F.linear(first, w["pooler.dense.weight"], w["pooler.dense.bias"]))
        return F.linear(pooled, w["classifier.weight"], w["classifier.bias"])

    def sparse(self, hidden: torch.Tensor) -> torch.Tensor:
        """BGE-M3's lexical weights: [B, T, D] → [B, T], relu(linear) per token."""
        w = self.w
        return torch.relu(F.linear(hidden, w["sparse_linear.weight"], w["sparse_linear.bias"])).squeeze(-1)

    def colbert(self, hidden: torch.Tensor) -> torch.Tensor:
        """BGE-M3's multi-vector output: [B, T, D] → [B, T - 1, D'] for the tokens after the first,
        L2-normalised (the caller keeps each input's real tokens)."""
        w = self.w
        return F.normalize(F.linear(hidden[:, 1:], w["colbert_linear.weight"], w["colbert_linear.bias"]), dim=-1)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"],
                            self.cfg.layer_norm_eps)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.cfg.activation == "relu":
            return torch.relu(h)
        return F.gelu(h, approximate="none" if self.cfg.activation == "gelu" else "tanh")


def _unpack(x: torch.Tensor, real: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Packed rows [N, C] back to their places among `rows` (zeros at padding); None: nothing was packed."""
    if real is None:
        return x
    out = x.new_zeros((rows, x.shape[-1]))
    out[real] = x
    return out


def _required(cfg: EncoderConfig, spec: PoolingSpec) -> list[str]:
    names = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
             "embeddings.LayerNorm.weight"]
    names += [f"encoder.layer.{i}.qkv.weight" for i in range(cfg.num_layers)]
    if spec.kind is ModelKind.CLASSIFY:
        names += ["classifier.out_proj.weight"] if spec.model_type == "xlm-roberta" else \
            ["pooler.dense.weight", "classifier.weight"]
    if spec.has_head("sparse"):
        names.append("sparse_linear.weight")
    if spec.has_head("colbert"):
        names.append("colbert_linear.weight")
    return names


def _load(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor under our names, q/k/v fused into one [3D, D] matrix per layer."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        for name, t in load_file(str(file)).items():
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            raw[name] = t
    for head in ("sparse_linear", "colbert_linear"):  # BGE-M3 ships these as torch state dicts
        if (path / f"{head}.pt").is_file():
            for key, t in torch.load(path / f"{head}.pt", map_location="cpu", weights_only=True).items():
                raw[f"{head}.{key}"] = t
    i = 0
    while f"encoder.layer.{i}.attention.self.query.weight" in raw:
        p = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            raw[p + "qkv." + kind] = torch.cat([raw.pop(f"{p}attention.self.{n}.{kind}")
                                                for n in ("query", "key", "value")])
        i += 1
    raw.pop("embeddings.position_ids", None)
    return {n: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
            for n, t in raw.items()}
