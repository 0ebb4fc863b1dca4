"""Prefill chunks on torch's brgemm (backend/csrc/gemm_bf16.h): x rounded to bfloat16 times the n16 blocks
dequantized and rounded to bfloat16, products summed and returned in float32 — on a CPU with AMX-BF16 the
default for prefill-sized batches (backend/ops.py KernelOps._brgemm). Elsewhere these skip: that CPU has no
bfloat16 tiles, and its prefill keeps the other paths (test_kquant.py)."""
from __future__ import annotations

import pytest
import torch

from backend import kernels
from backend.ops import N16_GEMM_ROWS, KernelOps
from backend.quant import QuantWeight, StackedWeight
from tests.backend.test_kquant import random_n16

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None or not kernels.cpu_has_native_bf16() or not K.could_brgemm_bf16(),
                                reason="no bfloat16 tiles (AMX-BF16) the OS grants on this CPU")

KINDS = ["q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "q5_k8", "q6_k8"]


def rounded_product(x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ W^T of the bfloat16-rounded operands in float64, and |x| @ |W|^T (the size of what float32 sums lose)."""
    xb, wb = x.to(torch.bfloat16).double(), w.dequantize().to(torch.bfloat16).double()
    return xb @ wb.T, xb.abs() @ wb.abs().T


def mins(w: QuantWeight) -> torch.Tensor:
    return w.m if w.m is not None else w.d


@pytest.mark.parametrize("kind", KINDS)
def test_the_product_of_the_rounded_operands_in_float32(kind: str) -> None:
    """Every kind, several panels (K=8192: four groups of 16 columns a panel, six groups), row blocks with a
    tail (rows=64, 203 rows) and K in slices summed by brgemm (depth=1024): each output within float32 sums'
    rounding of the exact product of the rounded operands — and not the float32 product."""
    n, k = 96, 8192
    w = random_n16(kind, n, k, seed=7)
    x = torch.randn(203, k, generator=torch.Generator().manual_seed(7))
    want, scale = rounded_product(x, w)
    for rows, depth in [(64, 1024), (128, 8192), (7, 32)]:
        got = K.n16_gemm_bf16(x.to(torch.bfloat16), w.qs, w.d, mins(w), kind == "q4_1", rows, depth)
        assert got.dtype == torch.float32 and got.shape == (203, n)
        err = (got.double() - want).abs()
        assert (err <= 1e-5 * scale + 1e-6).all(), (rows, depth, float((err / scale).max()))
    exact = x.double() @ w.dequantize().double().T
    assert ((got.double() - exact).abs() > 3e-6 * scale).float().mean() > 0.5  # it rounded the operands


def test_bad_arguments_are_refused() -> None:
    w = random_n16("q4_k", 32, 256, seed=1)
    x = torch.randn(4, 256)
    with pytest.raises(RuntimeError, match="bfloat16"):
        K.n16_gemm_bf16(x, w.qs, w.d, w.m, False)  # float32 x
    with pytest.raises(RuntimeError, match="bfloat16"):
        K.n16_gemm_bf16(torch.randn(4, 128).bfloat16(), w.qs, w.d, w.m, False)  # K mismatch
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.n16_gemm_bf16(x.bfloat16(), w.qs, w.d, w.m, False, 64, 48)
    with pytest.raises(RuntimeError, match="panel_groups > 0"):
        K.n16_gemm_bf16(x.bfloat16(), w.qs, w.d, w.m, False, panel_groups=0)
    with pytest.raises(RuntimeError, match="panel_groups > 0"):
        K.n16_gemm_bf16_silu(x.bfloat16(), w.qs, w.d, w.m, False, panel_groups=0)


def test_the_panel_width_does_not_change_a_bit() -> None:
    """Panels split the columns only: each output's sums run over K in the same slices whatever the panel width
    (one group of 16 columns, 3, the default), with a thread count that leaves panels of unequal width."""
    w, gu = random_n16("q6_k", 16 * 13, 4096, seed=5), random_n16("q4_k", 16 * 12, 4096, seed=6)
    xb = torch.randn(150, 4096, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = K.n16_gemm_bf16(xb, w.qs, w.d, mins(w), False)
    gate_up = K.n16_gemm_bf16_silu(xb, gu.qs, gu.d, mins(gu), False)
    for groups in (1, 3, 16):
        assert torch.equal(K.n16_gemm_bf16(xb, w.qs, w.d, mins(w), False, panel_groups=groups), want)
        assert torch.equal(K.n16_gemm_bf16_silu(xb, gu.qs, gu.d, mins(gu), False, panel_groups=groups), gate_up)


def test_prefill_sized_linears_take_it_with_bias_residual_and_stacked_parts() -> None:
    """KernelOps with PREFILL_GEMM=bfloat16 here: from N16_GEMM_ROWS rows a linear is brgemm's bits (+ bias,
    + residual; a stacked gate_up each part into its columns); below, the int16 kernel's."""
    ops = KernelOps(K, "bfloat16")
    assert ops.brgemm_bf16
    k = 512
    gate, up = random_n16("q4_k", 64, k, seed=2), random_n16("q6_k", 32, k, seed=3)
    x = torch.randn(N16_GEMM_ROWS + 9, k, generator=torch.Generator().manual_seed(2))
    bias, residual = torch.randn(64), torch.randn(N16_GEMM_ROWS + 9, 64)
    tiles = K.n16_gemm_bf16(x.to(torch.bfloat16), gate.qs, gate.d, gate.m, False)
    assert torch.equal(ops.linear(x, gate), tiles)
    assert torch.equal(ops.linear(x, gate, bias, residual), residual + (tiles + bias))
    stacked = StackedWeight([gate, up])
    both = torch.cat([tiles, K.n16_gemm_bf16(x.to(torch.bfloat16), up.qs, up.d, up.m, False)], dim=-1)
    assert torch.equal(ops.linear(x, stacked), both)
    transposed = x.T.contiguous().T  # the same values, column-major
    assert torch.equal(ops.linear(transposed, gate), tiles)
    assert torch.equal(ops.linear(transposed, stacked), both)
    short = x[:N16_GEMM_ROWS - 1]
    assert torch.equal(ops.linear(short, gate), KernelOps(K, "int16").linear(short, gate))
    assert not KernelOps(K, "float32").brgemm_bf16 and not KernelOps(K, "int16").brgemm_bf16


def test_bias_residual_and_a_strided_out_are_added_in_place() -> None:
    """The epilogue: (product + bias) + residual, the same bits as adding them after; out a column slice of a
    wider float32 (a stacked matrix's part) gets exactly those columns."""
    w = random_n16("q4_k", 48, 512, seed=4)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    bias, residual = torch.randn(48), torch.randn(70, 48)
    plain = K.n16_gemm_bf16(x, w.qs, w.d, w.m, False)
    assert torch.equal(K.n16_gemm_bf16(x, w.qs, w.d, w.m, False, bias=bias, residual=residual),
                       residual + (plain + bias))
    wide = torch.full((70, 100), 7.0)
    K.n16_gemm_bf16(x, w.qs, w.d, w.m, False, 16, 256, bias=bias, out=wide[:, 20:68])
    assert torch.equal(wide[:, 20:68], plain + bias)
    assert (wide[:, :20] == 7).all() and (wide[:, 68:] == 7).all()
    with pytest.raises(RuntimeError, match="residual"):
        K.n16_gemm_bf16(x, w.qs, w.d, w.m, False, residual=torch.randn(70, 47))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0"])
def test_gate_up_straight_to_silu_times_up(kind: str) -> None:
    """n16_gemm_bf16_silu is linear + silu_mul without the [T, 2F] product: the same bits as the kernel's
    silu_mul over n16_gemm_bf16's gate_up (rows in blocks with a tail, K in slices); KernelOps.gate_up_silu
    takes it from N16_GEMM_ROWS rows and is linear + silu_mul below."""
    f, k = 80, 1024
    w = random_n16(kind, 2 * f, k, seed=9)
    x = torch.randn(N16_GEMM_ROWS + 45, k, generator=torch.Generator().manual_seed(9))
    xb = x.to(torch.bfloat16)
    want = K.silu_mul(K.n16_gemm_bf16(xb, w.qs, w.d, mins(w), kind == "q4_1"))
    for rows, depth in [(128, 2048), (50, 256)]:
        assert torch.equal(K.n16_gemm_bf16_silu(xb, w.qs, w.d, mins(w), kind == "q4_1", rows, depth), want)
    ops = KernelOps(K, "bfloat16")
    assert torch.equal(ops.gate_up_silu(x, w), want)
    assert torch.equal(ops.gate_up_silu(x.T.contiguous().T, w), want)
    short = x[:N16_GEMM_ROWS - 1]
    assert torch.equal(ops.gate_up_silu(short, w), K.silu_mul(ops.linear(short, w)))
    # A gate_up whose halves differ in kind (stacked parts): linear (each part on brgemm) + silu_mul.
    stacked = StackedWeight([random_n16("q4_k", f, k, seed=10), random_n16("q6_k", f, k, seed=11)])
    assert torch.equal(ops.gate_up_silu(x, stacked), K.silu_mul(ops.linear(x, stacked)))
