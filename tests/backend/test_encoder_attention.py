"""The encoder's attention over packed sequences (backend/encoder_attention.py): the AVX-512 kernel against the
per-sequence SDPA reference, and a batch of mixed lengths against each input run alone (the embedded MiniLM)."""
from __future__ import annotations

import copy

import pytest
import torch

from backend.encoder import EncoderModel
from backend.encoder_attention import attention_kernel, packed_attention
from kvyard.pooling_model import embedded_embedding_path, load_pooling_spec


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_kernel_matches_per_sequence_sdpa(head_dim: int) -> None:
    kernel = attention_kernel(torch.float32, torch.device("cpu"), head_dim)
    if kernel is None:
        pytest.skip("no AVX-512 kernels on this machine")
    torch.manual_seed(0)
    heads, lengths = 3, [1, 5, 16, 17, 40, 0, 7]  # one row, panel edges, an empty sequence
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim) * 2
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    ours = packed_attention(kernel, qkv, offsets, lengths, heads)
    ref = packed_attention(None, qkv, offsets, lengths, heads)
    assert ours.shape == ref.shape == (sum(lengths), heads * head_dim)
    assert torch.allclose(ours, ref, atol=1e-5)


@pytest.mark.parametrize("kernel_dim", [None, 32])
def test_a_window_sees_only_the_keys_within_it(kernel_dim: int | None) -> None:
    """window=4 (ModernBERT's local layers): against attention written out with the band as a mask; sequences
    no longer than 5 tokens see all of themselves; with the kernel (which attends whole sequences) too."""
    head_dim = kernel_dim or 16
    kernel = attention_kernel(torch.float32, torch.device("cpu"), head_dim) if kernel_dim else None
    if kernel_dim and kernel is None:
        pytest.skip("no AVX-512 kernels on this machine")
    torch.manual_seed(0)
    heads, lengths, window = 2, [3, 5, 6, 20, 1], 4
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim) * 2
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    ours = packed_attention(kernel, qkv, offsets, lengths, heads, window)
    start = 0
    for n in lengths:
        q, k, v = qkv[start:start + n].view(n, 3, heads, head_dim).permute(1, 2, 0, 3)  # [H, n, d]
        scores = q @ k.transpose(-1, -2) / head_dim ** 0.5
        far = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() > window
        ref = (scores.masked_fill(far, float("-inf")).softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        assert torch.allclose(ours[start:start + n], ref, atol=1e-5), n
        start += n
    whole = packed_attention(kernel, qkv, offsets, lengths, heads)
    assert torch.allclose(ours[:8], whole[:8], atol=1e-5)  # 3 and 5 tokens: all within the window
    assert not torch.allclose(ours[8:14], whole[8:14], atol=1e-3)  # 6: the ends no longer see each other


def test_mixed_length_batch_equals_each_input_alone() -> None:
    spec = load_pooling_spec(embedded_embedding_path())
    model = EncoderModel(spec, torch.float32, torch.device("cpu"))
    reference = copy.copy(model)
    reference._kernel = None  # the per-sequence SDPA path
    torch.manual_seed(0)
    lengths = [3, 40, 1, 17, 64]
    ids = torch.randint(1000, 20000, (len(lengths), max(lengths)))
    mask = torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]   # [B, T]
    ids = ids * mask
    types = torch.zeros_like(ids)
    batch = model.forward(ids, types, mask)                              # [B, T, D]
    assert torch.allclose(batch, reference.forward(ids, types, mask), atol=1e-5)
    assert not batch[~mask].any()  # zeros at padding
    for b, n in enumerate(lengths):
        alone = model.forward(ids[b:b + 1, :n], types[b:b + 1, :n], mask[b:b + 1, :n])[0]
        assert torch.allclose(batch[b, :n], alone, atol=1e-5)
