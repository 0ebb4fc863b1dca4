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
