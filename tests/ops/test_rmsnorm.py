"""Fused FP8 RMSNorm: Triton against its torch reference, and the reference against fp32 RMSNorm."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, assert_close_f32, assert_fp8_close, interpreted, rel_err  # noqa: I001
from megacoat.fp8.formats import E4M3
from megacoat.ops import rmsnorm as R
from megacoat.ops.numerics import group_dequantize

U = E4M3.unit_roundoff  # 2^-4: worst relative error of one round-to-nearest E4M3 cast (normal range)
SHAPES = [(37, 192, 128), (16, 256, 64), (8, 320, 32)]  # hidden sizes that G does not divide included


def _inputs(m, h):
    x = torch.randn(m, h, device=DEV) * 3
    x[0, :5] = 0.0  # a few exact zeros (and, with G=32 on row 0, no all-zero group)
    return x.to(torch.bfloat16), (1 + 0.2 * torch.randn(h, device=DEV)).to(torch.bfloat16)


@pytest.mark.parametrize("m,h,g", SHAPES)
def test_triton_matches_reference(m, h, g):
    if DEV == "cpu" and not interpreted(R._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    x, w = _inputs(m, h)
    ta, ra = R.rmsnorm_fp8_fwd_triton(x, w, 1e-5, g), R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, g)
    assert_fp8_close(ta[0], ra[0])
    assert_close_f32(ta[1], ra[1])  # group scales come from the exact amax: identical
    # rstd and the output scale read the dequantized x, so on CPU they inherit the interpreter's casts
    tol = 1e-5 if DEV == "cuda" else 2e-2
    assert_close_f32(ta[2], ra[2], rtol=tol, atol=0)
    assert_close_f32(ta[3], ra[3], rtol=tol, atol=0)
    for transpose in (False, True):
        assert_fp8_close(R.rmsnorm_fp8_out_triton(*ra[:3], w, ra[3], g, transpose),
                         R.rmsnorm_fp8_out_ref(*ra[:3], w, ra[3], g, transpose))
    dy = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    (tdx, tdw), (rdx, rdw) = (R.rmsnorm_fp8_bwd_triton(dy, *ra[:3], w, g), R.rmsnorm_fp8_bwd_ref(dy, *ra[:3], w, g))
    assert tdx.dtype == torch.bfloat16
    assert_close_f32(tdx, rdx, rtol=1e-2, atol=1e-2)  # both bf16-rounded from fp32 sums in different orders
    assert_close_f32(tdw, rdw, rtol=1e-4, atol=1e-3)


def test_zero_row_and_group():
    """A zero row (padding) and a zero group: scales floored at tiny / fmax, FP8 zeros, rstd = 1/sqrt(eps)."""
    if DEV == "cpu" and not interpreted(R._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    x, w = _inputs(6, 256)
    x[2] = 0
    x[4, 64:128] = 0
    ta, ra = R.rmsnorm_fp8_fwd_triton(x, w, 1e-5, 64), R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 64)
    assert not ta[0].float().isnan().any() and (ta[0][2].float() == 0).all() and (ta[0][4, 64:128].float() == 0).all()
    assert_close_f32(ta[1], ra[1], rtol=0, atol=0)
    assert_close_f32(ta[2][2], ra[2][2], rtol=1e-6, atol=0)


def test_reference_against_fp32_rmsnorm():
    x, w = _inputs(64, 256)
    x8, xs, rstd, ys = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 64)
    y8 = R.rmsnorm_fp8_out_ref(x8, xs, rstd, w, ys, 64, transpose=False)
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    # two casts (the input per group, the output per tensor), each at most U relative on normal values
    assert rel_err(y8.float() * ys, want) <= 2 * U
    assert rel_err(group_dequantize(x8, xs, 64), xf) <= U


def test_backward_reference_is_the_gradient():
    """On the dequantized input (exactly what backward sees) the formula equals autograd in fp32."""
    x, w = _inputs(32, 192)
    x8, xs, rstd, _ = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 128)
    xd = group_dequantize(x8, xs, 128).requires_grad_()
    wf = w.float().requires_grad_()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wf
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, dw = R.rmsnorm_fp8_bwd_ref(dy, x8, xs, rstd, w, 128)
    assert_close_f32(dx, xd.grad, rtol=1e-4, atol=1e-5)
    assert_close_f32(dw, wf.grad, rtol=1e-4, atol=1e-4)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="rmsnorm expects"):
        R.rmsnorm_fp8_fwd(torch.randn(4, 8, 16), torch.ones(16), 1e-5, 16)
    with pytest.raises(ValueError, match="group size"):
        R.rmsnorm_fp8_fwd(torch.randn(4, 16), torch.ones(16), 1e-5, 24)


@pytest.mark.gpu
def test_gpu_large_shape_matches_reference():
    """Llama-2-7B's norm at 2048 tokens: one row per forward program (the per-tensor scale from the last one),
    a persistent backward grid with many rows per program."""
    x, w = _inputs(2048, 4096)
    ta, ra = R.rmsnorm_fp8_fwd_triton(x, w, 1e-5, 128), R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 128)
    assert_fp8_close(ta[0], ra[0])
    assert_close_f32(ta[1], ra[1])
    assert_close_f32(ta[2], ra[2], rtol=1e-5, atol=0)
    assert_close_f32(ta[3], ra[3], rtol=1e-5, atol=0)
    assert_fp8_close(R.rmsnorm_fp8_out_triton(*ra[:3], w, ra[3], 128, True),
                     R.rmsnorm_fp8_out_ref(*ra[:3], w, ra[3], 128, True))
    dy = torch.randn(2048, 4096, device=DEV).to(torch.bfloat16)
    (tdx, tdw), (rdx, rdw) = (R.rmsnorm_fp8_bwd_triton(dy, *ra[:3], w, 128), R.rmsnorm_fp8_bwd_ref(dy, *ra[:3], w, 128))
    assert_close_f32(tdx, rdx, rtol=1e-2, atol=1e-2)
    assert_close_f32(tdw, rdw, rtol=1e-4, atol=1e-3)  # fp32 sums over 2048 rows in another order
