"""CpuBf16Ops (backend/ops.py): a CPU's bfloat16 decoder over dense weights runs RMSNorm and SiLU·up as one pass
of the C++ kernels (backend/csrc/bf16_rows.h) with the roundings of TorchOps' bfloat16 ops; the shapes the
kernels do not take go to TorchOps."""
from __future__ import annotations

import pytest
import torch

from backend import kernels
from backend.model import default_ops
from backend.ops import CpuBf16Ops, KernelOps, TorchOps

CPU = torch.device("cpu")
MODULE = kernels.load()
AVX512 = MODULE is not None and MODULE.has_avx512()
needs_avx512 = pytest.mark.skipif(not AVX512, reason="the kernels' AVX-512 code does not run here")


def same_roundings(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit for bit but for a rare last-bit flip where float32 sums in another order land on a tie (none seen)."""
    assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
    a, b = ours.float(), theirs.float()
    assert (a == b).float().mean() >= 0.999
    ulp = b.abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((a - b).abs() <= ulp).all()


def test_default_ops_by_device_and_dtype() -> None:
    assert isinstance(default_ops(CPU, torch.bfloat16), CpuBf16Ops if AVX512 else TorchOps)
    assert MODULE is None or isinstance(default_ops(CPU, torch.float32), KernelOps)


@needs_avx512
@pytest.mark.parametrize("shape", [(1064, 576), (7, 64), (3, 5, 128), (1, 2048)])
def test_rms_norm_rounds_as_torch(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 4).bfloat16()
    w = torch.randn(shape[-1], generator=g).bfloat16()
    ops = CpuBf16Ops(MODULE)
    same_roundings(ops.rms_norm(x, w, 1e-6), TorchOps().rms_norm(x, w, 1e-6))
    strided = x[..., : shape[-1] // 2]  # not contiguous: the kernel reads a copy
    same_roundings(ops.rms_norm(strided, w[: shape[-1] // 2], 1e-6), TorchOps().rms_norm(strided, w[: shape[-1] // 2], 1e-6))


@needs_avx512
@pytest.mark.parametrize("shape", [(1064, 3072), (5, 64), (1, 17920)])
def test_silu_mul_rounds_as_torch_in_place(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[0])
    gate_up = (torch.randn(shape, generator=g) * 6).bfloat16()
    theirs = TorchOps().silu_mul(gate_up.clone())
    mine = gate_up.clone()
    out = CpuBf16Ops(MODULE).silu_mul(mine)
    same_roundings(out, theirs)
    assert out.data_ptr() == mine.data_ptr() and out.shape == (shape[0], shape[1] // 2)  # the gate half, in place


@needs_avx512
def test_what_the_kernels_do_not_take_goes_to_torch() -> None:
    """Rows not a multiple of 16, float32 tensors, a float32 weight under bfloat16 rows (torch promotes)."""
    ops, ref = CpuBf16Ops(MODULE), TorchOps()
    x = torch.randn(4, 40).bfloat16()
    assert torch.equal(ops.rms_norm(x, torch.ones(40).bfloat16(), 1e-6), ref.rms_norm(x, torch.ones(40).bfloat16(), 1e-6))
    y = torch.randn(4, 64)
    assert torch.equal(ops.rms_norm(y, torch.ones(64), 1e-6), ref.rms_norm(y, torch.ones(64), 1e-6))
    promoted = ops.rms_norm(torch.randn(4, 64).bfloat16(), torch.ones(64), 1e-6)
    assert promoted.dtype == torch.float32
    odd = torch.randn(3, 48).bfloat16()  # F = 24
    assert torch.equal(ops.silu_mul(odd.clone()), ref.silu_mul(odd.clone()))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        MODULE.rms_norm_bf16(x, torch.ones(40).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="bfloat16"):
        MODULE.silu_mul_bf16_(torch.randn(2, 64))


@needs_avx512
@pytest.mark.parametrize(("heads", "d"), [((9, 3), 64), ((4, 4), 128), ((2, 1), 32)])
def test_rope_store_rounds_as_torch_and_fills_the_same_slots(heads: tuple[int, int], d: int) -> None:
    from backend.attention import KVCache
    H, Hkv = heads
    T = 37
    g = torch.Generator().manual_seed(d)
    qkv = (torch.randn(T, (H + 2 * Hkv) * d, generator=g) * 3).bfloat16()
    angles = torch.arange(100, 100 + T)[:, None] * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(64, generator=g)[:T]
    caches = [KVCache(2, 8, 8, Hkv, d, torch.bfloat16, CPU) for _ in range(2)]
    ours = CpuBf16Ops(MODULE).rope_store(qkv, cos, sin, caches[0], 1, slots, H, Hkv)
    theirs = TorchOps().rope_store(qkv, cos, sin, caches[1], 1, slots, H, Hkv)
    same_roundings(ours, theirs)
    same_roundings(caches[0].data[1, 0].flatten(0, 1), caches[1].data[1, 0].flatten(0, 1))  # k, at the same slots
    assert torch.equal(caches[0].data[1, 1], caches[1].data[1, 1])                          # v, as given
    assert not caches[0].data[0].any()                                                     # another layer untouched
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuBf16Ops(MODULE).rope_store(qkv, cos, sin, caches[0], 1, slots + 1000, H, Hkv)


@needs_avx512
def test_rope_store_of_another_cache_dtype_goes_to_torch() -> None:
    from backend.attention import KVCache
    qkv = torch.randn(3, 4 * 64).bfloat16()
    angles = torch.arange(3)[:, None] * torch.rand(32)[None, :]
    caches = [KVCache(1, 2, 8, 1, 64, torch.float16, CPU) for _ in range(2)]
    slots = torch.tensor([0, 5, 9])
    ours = CpuBf16Ops(MODULE).rope_store(qkv, angles.cos(), angles.sin(), caches[0], 0, slots, 2, 1)
    assert torch.equal(ours, TorchOps().rope_store(qkv, angles.cos(), angles.sin(), caches[1], 0, slots, 2, 1))
    assert torch.equal(caches[0].data, caches[1].data)
