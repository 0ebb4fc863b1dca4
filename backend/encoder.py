"""The encoder model family: token ids → hidden states → the checkpoint's heads. The pooling engine
(backend/pooling_engine.py) runs it one batch per step, packed: no padding.

Post-LayerNorm transformer blocks with learned absolute positions (BERT; RoBERTa/XLM-R/CamemBERT's from the
padding index; DistilBERT's names; MPNet's from 2, plus a learned relative-position bias per head), read from a
Hugging Face safetensors directory (backend/encoder_weights.py: each family's names → BERT's) or a GGUF of
llama.cpp's `bert` architecture (dequantized at load); or rotary positions (NeoX halves) on q and k with a GLU
feed-forward: Nomic BERT (a GGUF's `nomic-bert` or a directory: SwiGLU, no biases), GTE (GeGLU, biases, the
fixed NTK scaling of Alibaba's configs); or ModernBERT's pre-norm layers (its first without a norm, a final norm
after the last): rotary positions at a base per layer kind, every few layers attending globally and the others
within a window, a GeGLU FFN. (EmbeddingGemma is backend/gemma_encoder.py's; static embeddings
backend/static_embedding.py's.) Heads:
- classify: BERT's pooler (tanh of a dense layer over [CLS]) and `classifier` (GTE's too); RoBERTa's and MPNet's
  `classifier.dense` (tanh) and `classifier.out_proj` over <s>; DistilBERT's ReLU `pre_classifier` over [CLS];
  ModernBERT's `head` (dense, its activation, a norm) over [CLS] or the mean of the tokens, then `classifier`.
  Logits out; the frontend turns them into probabilities.
- sparse / colbert (BGE-M3, `sparse_linear.pt` / `colbert_linear.pt` beside the weights): relu of a
  linear per token, and a linear per token after the first, L2-normalised.
DTYPE=bfloat16 on a CPU keeps the layers' matrices in bfloat16 (oneDNN multiplies them on AMX-BF16 tiles where the
CPU has them) and everything between them in float32: the embeddings, norms, attention (the float32 kernel),
activations and residual stream. On a GPU bfloat16 is everything's dtype."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend import kernels
from backend.encoder_attention import attention_kernel, packed_attention
from backend.encoder_weights import LAYER_LINEARS, load_encoder_weights
from backend.st_dense import dense_bytes, load_dense
from kvyard.encoder_families import ROBERTA_TYPES
from kvyard.gguf_meta import read_gguf_index
from kvyard.model_path import ModelFileError, is_gguf
from kvyard.pooling_model import ModelKind, PoolingSpec



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
    rope_theta: float = 0.0    # rotary positions' base (Nomic BERT: 1000); 0: learned absolute positions
    prenorm: bool = False      # ModernBERT: a norm before attention and FFN (none before layer 0), one at the end
    sliding: tuple[int, ...] = ()  # layers attending only to keys within `window` positions (ModernBERT's local)
    window: int = 0            # ... |query - key| <= window (ModernBERT: local_attention // 2)
    local_rope_theta: float = 0.0  # the sliding layers' rotary base (ModernBERT: 10000)
    head_pooling: str = "cls"      # a ModernBERT classifier's: "cls" or "mean" (classifier_pooling)
    head_activation: str = "gelu"  # ... and its head's activation (classifier_activation, an ACT2FN key)
    ntk_factor: float = 1.0        # GTE's `new` checkpoints' fixed NTK scaling: base x f, frequencies / f^(2/d)
    relative_buckets: int = 0      # MPNet: a learned bias per head and bucket of key - query distance (32)

    @classmethod
    def from_gguf(cls, path: Path) -> EncoderConfig:
        """llama.cpp's `bert` metadata (BERT's GELU, absolute positions from 0), `nomic-bert`'s (SwiGLU, rotary
        positions at `rope.freq_base`) or `modern-bert`'s (pre-norm; every `sliding_window_pattern`-th layer
        global from the first, the others within `sliding_window / 2` positions at `rope.freq_base_swa`)."""
        index = read_gguf_index(path)
        meta, arch = index.meta, index.meta.get("general.architecture")
        nomic, modern = arch == "nomic-bert", arch == "modern-bert"
        try:
            common = dict(vocab_size=index.tensors["token_embd.weight"].shape[0],
                          hidden_size=int(meta[f"{arch}.embedding_length"]), num_layers=int(meta[f"{arch}.block_count"]),
                          num_heads=int(meta[f"{arch}.attention.head_count"]),
                          layer_norm_eps=float(meta[f"{arch}.attention.layer_norm_epsilon"]), position_offset=0,
                          type_vocab_size=index.tensors["token_types.weight"].shape[0] if "token_types.weight" in
                          index.tensors else 1)
            if modern:
                every, theta = int(meta.get(f"{arch}.attention.sliding_window_pattern", 3)), meta.get(f"{arch}.rope.freq_base")
                glu = "swiglu" if meta.get(f"{arch}.hidden_activation") == "silu" else "geglu"
                return cls(**common, activation=glu, rope_theta=float(theta or 10000.0), prenorm=True,
                           sliding=tuple(i for i in range(common["num_layers"]) if every == 0 or i % every != 0),
                           window=int(meta.get(f"{arch}.attention.sliding_window", 0)) // 2,
                           local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa") or theta or 10000.0))
            return cls(**common, activation="swiglu" if nomic else "gelu",
                       rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)) if nomic else 0.0)
        except KeyError as exc:
            raise ModelFileError(f"{path}: GGUF lacks {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: Path) -> EncoderConfig:
        cfg = json.loads((path / "config.json").read_text())
        xlmr = cfg["model_type"] in ROBERTA_TYPES
        if cfg["model_type"] == "modernbert":  # transformers' keys of 4.48+ or of 5 (layer_types, rope_parameters)
            n, rope = int(cfg["num_hidden_layers"]), cfg.get("rope_parameters") or {}
            kinds = cfg.get("layer_types") or ["full_attention" if i % int(cfg.get("global_attn_every_n_layers", 3)) == 0
                                               else "sliding_attention" for i in range(n)]
            act = cfg.get("hidden_activation", "gelu")
            return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]), num_layers=n,
                       num_heads=int(cfg["num_attention_heads"]), layer_norm_eps=float(cfg.get("norm_eps", 1e-5)),
                       activation="swiglu" if act == "silu" else "geglu", position_offset=0, type_vocab_size=0,
                       rope_theta=float((rope.get("full_attention") or {}).get("rope_theta")
                                        or cfg.get("global_rope_theta", 160000.0)),
                       prenorm=True, sliding=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
                       window=int(cfg.get("local_attention", 128)) // 2,
                       local_rope_theta=float((rope.get("sliding_attention") or {}).get("rope_theta")
                                              or cfg.get("local_rope_theta") or 10000.0),
                       head_pooling=str(cfg.get("classifier_pooling", "cls")),
                       head_activation=str(cfg.get("classifier_activation", "gelu")))
        if cfg["model_type"] in ("gte", "new"):  # transformers' GteConfig, or Alibaba's own (NewConfig's) keys
            rope = cfg.get("rope_parameters") or {}
            return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                       num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                       layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                       activation="swiglu" if cfg.get("hidden_act", "gelu") == "silu" else "geglu", position_offset=0,
                       type_vocab_size=int(cfg.get("type_vocab_size", 0 if cfg["model_type"] == "new" else 1)),
                       rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta")
                                        or (10000.0 if cfg["model_type"] == "new" else 160000.0)),
                       ntk_factor=float((cfg.get("rope_scaling") or {}).get("factor", 1.0)))
        if cfg["model_type"] == "mpnet":  # positions from padding_idx + 1 = 2, as transformers' MPNet counts them
            return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                       num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                       layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), activation=str(cfg.get("hidden_act", "gelu")),
                       position_offset=2, type_vocab_size=0,
                       relative_buckets=int(cfg.get("relative_attention_num_buckets", 32)))
        if cfg["model_type"] == "distilbert":  # BERT without segments, its LayerNorms at transformers' fixed 1e-12
            return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["dim"]), num_layers=int(cfg["n_layers"]),
                       num_heads=int(cfg["n_heads"]), layer_norm_eps=1e-12, activation=str(cfg.get("activation", "gelu")),
                       position_offset=0, type_vocab_size=0)
        if cfg["model_type"] == "nomic_bert":  # nomic-embed-text's own keys, or transformers' NomicBertConfig's
            theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rotary_emb_base") or 1000.0
            return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg.get("hidden_size") or cfg["n_embd"]),
                       num_layers=int(cfg.get("num_hidden_layers") or cfg["n_layer"]),
                       num_heads=int(cfg.get("num_attention_heads") or cfg["n_head"]),
                       layer_norm_eps=float(cfg.get("layer_norm_eps") or cfg.get("layer_norm_epsilon") or 1e-12),
                       activation="swiglu", position_offset=0, type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                       rope_theta=float(theta))
        return cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                   activation=str(cfg.get("hidden_act", "gelu")),
                   position_offset=int(cfg.get("pad_token_id", 1)) + 1 if xlmr else 0,
                   type_vocab_size=int(cfg.get("type_vocab_size", 2)))


# A CPU's bfloat16 GEMMs take rows in multiples of this (EncoderModel._linear).
ROW_BUCKET = 32


def _padded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype with its rows padded by zeros to a multiple of ROW_BUCKET: oneDNN builds (JITs) a GEMM per new
    shape, ~5 ms each on an AMX Xeon against ~0.6 ms for a cached one, and every batch brings a new token count."""
    n = x.shape[0]
    xb = x.new_empty((-(-n // ROW_BUCKET) * ROW_BUCKET, x.shape[1]), dtype=dtype)
    xb[:n].copy_(x)
    xb[n:].zero_()
    return xb


class EncoderModel:
    """Plain functions over a dict of tensors; no nn.Module (as backend/model.py)."""

    def __init__(self, spec: PoolingSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        gguf_file = is_gguf(spec.path)
        self.cfg = EncoderConfig.from_gguf(spec.path) if gguf_file else EncoderConfig.from_dir(spec.path)
        self.device = device
        self.dtype = dtype
        # The dtype between the matrices: float32 for a CPU's bfloat16 (its GEMMs on bfloat16 operands, the
        # rest exact; the packed attention kernel is float32's).
        self.act_dtype = torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype
        self.w = load_encoder_weights(spec.path, self.act_dtype, device, gguf_file)
        missing = [n for n in _required(self.cfg, spec) if n not in self.w]
        if missing:
            raise ModelFileError(f"{spec.path}: weights missing {', '.join(missing[:5])}")
        # The layers' matrices transposed once, [in, out]: x @ W^T then needs no transposed read of W, which
        # for one short sentence (a few rows, the weights streamed from memory) cut the linears by ~20-25%
        # and is no slower for a batch of 32 (one core, 6 layers' FFN: 3.1-3.9 vs 4.2-5.7 ms at 6 rows).
        for i in range(self.cfg.num_layers):
            for name in LAYER_LINEARS:
                key = f"encoder.layer.{i}.{name}.weight"
                self.w[key] = self.w[key].t().to(dtype).contiguous()
        # The up projections' biases in the matrices' dtype where that differs (EncoderModel._ffn adds them in the GEMM).
        self._up_bias = {f"encoder.layer.{i}.": self.w[f"encoder.layer.{i}.intermediate.dense.bias"].to(dtype)
                         for i in range(self.cfg.num_layers)} if dtype != self.act_dtype else {}
        self.dense = load_dense(spec.dense, self.act_dtype, device)
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        self._kernel = attention_kernel(self.act_dtype, device, head_dim)
        # Each post-norm layer's residual step in one pass (_residual_norm) under a CPU's bfloat16 matrices, AVX-512.
        self._fused_norm = kernels.load_avx512() if device.type == "cpu" and dtype != self.act_dtype and \
            not self.cfg.prenorm and self.cfg.hidden_size % 16 == 0 else None
        f = self.cfg.ntk_factor
        self._inv_freq = [1.0 / (theta * f) ** (torch.arange(0, head_dim, 2, device=device) / head_dim) / f ** (2 / head_dim)
                          for theta in (self.cfg.rope_theta, self.cfg.local_rope_theta) if theta]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values()) + dense_bytes(self.dense)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, type_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, type_ids: [B, T] int64; mask: [B, T] bool (True = a real token, padding on the right).
        Returns the last hidden states [B, T, D] (zeros at padding)."""
        B, T = ids.shape
        real = mask.reshape(-1).nonzero().squeeze(1)                       # [N] real tokens' places in B * T
        positions = torch.arange(T, device=ids.device).repeat(B)[real]     # [N]
        lengths = mask.sum(dim=1)                                          # [B]
        x = self.packed(ids.reshape(-1)[real], type_ids.reshape(-1)[real], positions, lengths)  # [N, D]
        out = x.new_zeros((B * T, x.shape[-1]))
        out[real] = x
        return out.view(B, T, -1)

    def packed(self, ids: torch.Tensor, type_ids: torch.Tensor, positions: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
        """The sequences packed one after another, no padding: ids, type_ids, positions (from 0 in each
        sequence) [N] int64; lengths [B] (summing to N). Returns the last hidden states [N, D]. Every op but
        attention works on the [N, D] rows as they are; attention (backend/encoder_attention.py) sees each
        sequence alone."""
        w, cfg = self.w, self.cfg
        D, H = cfg.hidden_size, cfg.num_heads
        x = w["embeddings.word_embeddings.weight"][ids]
        if not self._inv_freq:
            x += w["embeddings.position_embeddings.weight"][positions + cfg.position_offset]
        rotary = [self._rotary(positions, f) for f in self._inv_freq]  # [global, local]: each layer's (cos, sin)
        if "embeddings.token_type_embeddings.weight" in w:  # one segment (XLM-R): every token is segment 0
            x += w["embeddings.token_type_embeddings.weight"][type_ids if cfg.type_vocab_size > 1 else 0]
        x = self._norm(x, "embeddings.LayerNorm")                          # [N, D]
        offsets = F.pad(lengths.cumsum(0), (1, 0)).cpu()                  # [B + 1]
        sizes = lengths.tolist()
        bias = self._relative_bias(max(sizes)) if cfg.relative_buckets else None  # [H, T, T], every layer's
        # The two widest activations reuse one buffer each through the layers (fewer fresh pages to fault in).
        qkv = x.new_empty((x.shape[0], 3 * D))                              # [N, 3D]
        h = x.new_empty((x.shape[0], w["encoder.layer.0.intermediate.dense.weight"].shape[1])) \
            if self.dtype == self.act_dtype else None  # [N, 4D] (GLU: [N, 2I]); bfloat16 matrices: _ffn's own
        xb = _padded(x, self.dtype) if self._fused_norm is not None else None  # [N padded, D], the next GEMM's input
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}."
            local = i in cfg.sliding
            pre = p + "attention.norm"  # ModernBERT's; none before its first layer
            if xb is not None:
                self._float_out(xb, p + "qkv", x.shape[0], qkv)
            else:
                self._linear(self._norm(x, pre) if pre + ".weight" in w else x, p + "qkv", qkv)
            if rotary:
                _rotate(qkv[:, :2 * D].view(-1, 2 * H, D // H), *rotary[local])  # q and k, every head
            a = packed_attention(self._kernel, qkv, offsets, sizes, H, cfg.window if local else 0, bias)  # [N, D]
            if cfg.prenorm:
                x = self._linear(a, p + "attention.output.dense").add_(x)
                x = self._ffn(self._norm(x, p + "ffn.norm"), p, h).add_(x)
                continue
            if xb is not None:  # bfloat16 matrices: each residual step in one pass, x in place, xb its copy
                self._residual_norm(torch.mm(_padded(a, self.dtype), w[p + "attention.output.dense.weight"]),
                                    p + "attention.output", x, xb)
                g = self._act(torch.addmm(self._up_bias[p], xb, w[p + "intermediate.dense.weight"]))
                self._residual_norm(torch.mm(g, w[p + "output.dense.weight"]), p + "output", x, xb)
                continue
            x = self._norm(self._linear(a, p + "attention.output.dense").add_(x), p + "attention.output.LayerNorm")
            x = self._norm(self._ffn(x, p, h).add_(x), p + "output.LayerNorm")
        return self._norm(x, "final_norm") if cfg.prenorm else x

    def _residual_norm(self, y: torch.Tensor, p: str, x: torch.Tensor, xb: torch.Tensor) -> None:
        """x ← LayerNorm(y[:N] + the dense layer's bias + x), xb ← x in bfloat16 (backend/csrc/encoder_norm.h)."""
        assert self._fused_norm is not None
        self._fused_norm.residual_norm_bf16(y, self.w[p + ".dense.bias"], x, self.w[p + ".LayerNorm.weight"],
                                            self.w[p + ".LayerNorm.bias"], self.cfg.layer_norm_eps, xb)

    def _relative_bias(self, n: int) -> torch.Tensor:
        """MPNet's [H, n, n] bias: the learned value of each head for the bucket of key - query distance (exact
        below 8 either way, then logarithmic up to 128; 16 buckets a direction)."""
        i = torch.arange(n, device=self.device)
        buckets = _relative_bucket(i[None, :] - i[:, None], self.cfg.relative_buckets)       # [n, n]
        return self.w["encoder.relative_attention_bias.weight"][buckets].permute(2, 0, 1).contiguous()

    def _rotary(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, 1, d/2] of each token's position (float32 angles, then the model's dtype)."""
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        return angles.cos().to(self.act_dtype)[:, None], angles.sin().to(self.act_dtype)[:, None]

    def classify(self, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden: [B, T, D] (zeros at padding) → logits [B, num_labels], from the first token or (a ModernBERT
        head's "mean") every real one; mask [B, T] bool (ids: unused)."""
        w = self.w
        first = hidden[:, 0]                                                # [B, D]
        if "pre_classifier.weight" in w:  # DistilBERT: relu of a dense layer over [CLS]
            h = torch.relu(F.linear(first, w["pre_classifier.weight"], w["pre_classifier.bias"]))
            return F.linear(h, w["classifier.weight"], w["classifier.bias"])
        if "head.dense.weight" in w:  # ModernBERT: pool, dense, activation, norm, classifier
            pooled = first if self.cfg.head_pooling == "cls" else \
                hidden.sum(dim=1) / mask.sum(dim=1, keepdim=True).to(hidden.dtype)
            h = _HEAD_ACTS[self.cfg.head_activation](F.linear(pooled, w["head.dense.weight"], w.get("head.dense.bias")))
            return F.linear(self._norm(h, "head.norm"), w["classifier.weight"], w["classifier.bias"])
        if self.spec.model_type in (*ROBERTA_TYPES, "mpnet"):  # RoBERTa's head
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

    def _linear(self, x: torch.Tensor, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + b for one of a layer's matrices (held transposed), into `out` when given. W in bfloat16
        under float32 activations (a CPU's DTYPE=bfloat16): x rounded to bfloat16 for the GEMM, its float32
        result plus the float32 bias."""
        weight = self.w[name + ".weight"]
        if weight.dtype == x.dtype:
            return torch.addmm(self.w[name + ".bias"], x, weight, out=out)
        return self._float_out(_padded(x, weight.dtype), name, x.shape[0], out)

    def _float_out(self, xb: torch.Tensor, name: str, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """xb (the matrices' dtype, rows padded) @ W^T: its first n rows in float32 plus the float32 bias."""
        y = torch.mm(xb, self.w[name + ".weight"])[:n]
        # A copy to float32 then the bias: ~20 % faster than one mixed-dtype add (1376 x 1536 on 2 threads).
        return (y.float() if out is None else out.copy_(y)).add_(self.w[name + ".bias"])

    def _ffn(self, x: torch.Tensor, p: str, h: torch.Tensor | None) -> torch.Tensor:
        """A layer's feed-forward before its residual: up (into h), activation, down. Under float32 activations
        with bfloat16 matrices the wide [N, 4D] activations stay bfloat16 (rows padded): the up GEMM adds its
        bias in its float32 sums and rounds once, which is what the down GEMM would round its input to anyway;
        a MiniLM batch skips two conversions and a float32 pass over its widest tensor per layer."""
        up = self.w[p + "intermediate.dense.weight"]
        if up.dtype == x.dtype:
            return self._linear(self._act(self._linear(x, p + "intermediate.dense", h)), p + "output.dense")
        g = self._act(torch.addmm(self._up_bias[p], _padded(x, up.dtype), up))
        return self._float_out(g, p + "output.dense", x.shape[0])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"],
                            self.cfg.layer_norm_eps)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """In place on the fresh [N, 4D] activations: a new tensor per layer cost more in page faults than the
        GELU itself (a MiniLM batch of 32, one thread: ~10,000 → ~6,000 minor faults, system time 19-21 →
        13 ms). SwiGLU / GeGLU: [N, 2I], the activation's half first → act(first) * second, [N, I] (in the first
        half's place)."""
        if self.cfg.activation in ("swiglu", "geglu"):
            first, second = h.chunk(2, dim=-1)
            act = F.silu(first, inplace=True) if self.cfg.activation == "swiglu" else \
                torch.ops.aten.gelu_(first, approximate="none")
            return act.mul_(second)
        if self.cfg.activation == "relu":
            return torch.relu_(h)
        return torch.ops.aten.gelu_(h, approximate="none" if self.cfg.activation == "gelu" else "tanh")


# A ModernBERT classifier head's activations (transformers' ACT2FN; kvyard/encoder_families.HEAD_ACTIVATIONS).
_HEAD_ACTS = {"gelu": F.gelu, "gelu_new": lambda h: F.gelu(h, approximate="tanh"),
              "gelu_pytorch_tanh": lambda h: F.gelu(h, approximate="tanh"), "relu": F.relu, "silu": F.silu,
              "tanh": torch.tanh}


def _relative_bucket(relative: torch.Tensor, buckets: int, max_distance: int = 128) -> torch.Tensor:
    """T5's bidirectional buckets of key - query distance, as MPNet (and transformers) compute them."""
    half = buckets // 2
    n = -relative
    out = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return out + torch.where(n < exact, n, large.clamp(max=half - 1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [N, heads, d] in place: RoPE on the two halves of each head (GPT-NeoX's layout, llama.cpp's NEOX)."""
    lo, hi = x.chunk(2, dim=-1)
    lo_cos = lo * cos
    lo.mul_(sin)
    hi_sin = hi * sin
    hi.mul_(cos).add_(lo)
    lo.copy_(lo_cos - hi_sin)


def _required(cfg: EncoderConfig, spec: PoolingSpec) -> list[str]:
    names = ["embeddings.word_embeddings.weight", "embeddings.LayerNorm.weight"]
    if not cfg.rope_theta:
        names.append("embeddings.position_embeddings.weight")
    if cfg.prenorm:
        names += ["final_norm.weight"] + [f"encoder.layer.{i}.ffn.norm.weight" for i in range(cfg.num_layers)]
    names += [f"encoder.layer.{i}.qkv.weight" for i in range(cfg.num_layers)]
    if cfg.relative_buckets:
        names.append("encoder.relative_attention_bias.weight")
    if spec.kind is ModelKind.CLASSIFY:
        names += ["classifier.out_proj.weight"] if spec.model_type in (*ROBERTA_TYPES, "mpnet") else \
            ["head.dense.weight", "head.norm.weight", "classifier.weight"] if spec.model_type == "modernbert" else \
            ["pre_classifier.weight", "classifier.weight"] if spec.model_type == "distilbert" else \
            ["pooler.dense.weight", "classifier.weight"]
    if spec.has_head("sparse"):
        names.append("sparse_linear.weight")
    if spec.has_head("colbert"):
        names.append("colbert_linear.weight")
    return names
