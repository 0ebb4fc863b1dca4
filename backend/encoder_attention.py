"""An encoder layer's attention over packed sequences (backend/encoder.py): every token sees every token of its
own sequence, and no sequence is padded to the batch's longest.

The C++ kernel (backend/csrc/encoder_attention.h: float32 on an AVX-512 CPU) runs a layer as one parallel
region; elsewhere (CUDA, bf16, no AVX-512, KVYARD_KERNELS=0) one SDPA call per sequence, which is also the
reference in tests. Both replaced one SDPA over the padded batch with a mask, which did twice the work (a
batch of 32 sentences of 20-60 words is ~1,350 real tokens in ~2,016 padded) at ~18 GFLOP/s."""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

KERNEL_HEAD_DIMS = (32, 64, 96, 128)


def attention_kernel(dtype: torch.dtype, device: torch.device, head_dim: int) -> ModuleType | None:
    """The compiled kernels where they serve this model, else None."""
    if device.type != "cpu" or dtype != torch.float32 or head_dim not in KERNEL_HEAD_DIMS:
        return None
    from backend import kernels
    return kernels.load_avx512()


def packed_attention(kernel: ModuleType | None, qkv: torch.Tensor, offsets: torch.Tensor, lengths: list[int],
                     heads: int, window: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [N, 3 * H * d], each token's q, k and v heads side by side; sequence b is rows offsets[b] ..
    offsets[b + 1] (lengths[b] of them). window > 0: a token sees only the keys at most `window` positions
    away (ModernBERT's local layers); a sequence no longer than window + 1 sees all of itself. bias [H, T, T]
    (MPNet's relative-position bias, T the longest sequence): added to every sequence's scaled scores, its
    [:, :n, :n] corner (the kernel takes none: SDPA per sequence). → [N, H * d]."""
    N, D = qkv.shape[0], qkv.shape[1] // 3
    d = D // heads
    banded = {b for b, n in enumerate(lengths) if window and n > window + 1}
    if kernel is not None and len(banded) < len(lengths) and bias is None:
        out = kernel.encoder_attention(qkv, offsets, heads, d ** -0.5)
        todo = banded  # the kernel attends to whole sequences: the windowed ones again below
    else:
        out, todo = qkv.new_empty((N, D)), range(len(lengths))
    for b in todo:
        start, n = int(offsets[b]), lengths[b]
        q, k, v = qkv[start:start + n].view(n, 3, heads, d).permute(1, 2, 0, 3)    # each [H, n, d]
        mask = None if bias is None else bias[:, :n, :n]
        if b in banded:
            i = torch.arange(n, device=qkv.device)
            mask = (i[:, None] - i[None, :]).abs() <= window                     # [n, n]
        out[start:start + n].view(n, heads, d).copy_(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
    return out
