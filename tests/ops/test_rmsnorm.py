"""Fused FP8 RMSNorm: Triton against its torch reference, and the reference against fp32 RMSNorm."""
import pytest
import torch

from tests.ops.fp8_compare import (DEV, assert_close_f32, assert_delayed_meets_current,
                                   assert_delayed_scale_and_saturation, assert_fp8_close,  # noqa: I001
                                   interpreted, rel_err, same_bytes)
from megacoat.ops.formats import E4M3
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
    # y: the second launch derives the scale from the folded amax; the bytes of a launch given that scale
    assert same_bytes(ta[4], R.rmsnorm_fp8_out_triton(*ta[:3], w, ta[3], g, False))
    if DEV == "cuda":
        assert_fp8_close(ta[4], ra[4])
    for transpose in (False, True):
        assert_fp8_close(R.rmsnorm_fp8_out_triton(*ra[:3], w, ra[3], g, transpose),
                         R.rmsnorm_fp8_out_ref(*ra[:3], w, ra[3], g, transpose))
    dy = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    (tdx, tdw), (rdx, rdw) = (R.rmsnorm_fp8_bwd_triton(dy, *ra[:3], w, g), R.rmsnorm_fp8_bwd_ref(dy, *ra[:3], w, g))
    assert tdx.dtype == torch.bfloat16
    assert_close_f32(tdx, rdx, rtol=1e-2, atol=1e-2)  # both bf16-rounded from fp32 sums in different orders
    assert_close_f32(tdw, rdw, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("p,h", [(1, 5), (64, 32), (130, 200), (528, 96)])
def test_column_sum_of_the_dw_partials(p, h):
    """The backward's [P, H] dw partials summed per column in a fixed order: float32 sums of P terms, so within
    P * 2^-24 of the float64 sum's magnitude sum; and the same bits on every call (no atomics)."""
    if DEV == "cpu" and not interpreted(R._column_sum_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    parts = torch.randn(p, h, device=DEV) * torch.logspace(-3, 3, h, device=DEV)
    got = R.column_sum_triton(parts)
    exact = parts.double().sum(0)
    bound = p * 2.0 ** -24 * parts.double().abs().sum(0)
    assert got.dtype == torch.float32 and got.shape == (h,)
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(got, R.column_sum_triton(parts))


@pytest.mark.parametrize("m,h,g", SHAPES[:2])
def test_backward_adds_the_residual_gradient_before_its_one_rounding(m, h, g):
    """residual_grad (the block's other branch into the norm's input) is added to dx in fp32 and rounded once:
    the reference is that sum exactly, and the kernel matches it as it matches dx without one."""
    if DEV == "cpu" and not interpreted(R._bwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    x, w = _inputs(m, h)
    x8, xs, rstd = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, g)[:3]
    dy = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    res = (torch.randn(m, h, device=DEV) * 4).to(torch.bfloat16)
    rdx, rdw = R.rmsnorm_fp8_bwd_ref(dy, x8, xs, rstd, w, g, residual_grad=res)
    plain = R.rmsnorm_fp8_bwd_ref(dy.float(), x8, xs, rstd, w, g)[0]  # fp32 dx: no rounding before the add
    assert torch.equal(rdx, (plain + res.float()).to(torch.bfloat16))
    assert torch.equal(rdw, R.rmsnorm_fp8_bwd_ref(dy, x8, xs, rstd, w, g)[1])  # dw does not see the residual
    tdx, tdw = R.rmsnorm_fp8_bwd_triton(dy, x8, xs, rstd, w, g, residual_grad=res)
    assert_close_f32(tdx, rdx, rtol=1e-2, atol=1e-2)
    assert_close_f32(tdw, rdw, rtol=1e-4, atol=1e-3)
    assert not torch.equal(tdx, R.rmsnorm_fp8_bwd_triton(dy, x8, xs, rstd, w, g)[0])  # it was added


@pytest.mark.parametrize("m,h,g", SHAPES[:2])
@pytest.mark.parametrize("residual", [False, True])
def test_backward_folds_the_amax_of_dx(m, h, g, residual):
    """dx_amax: the kernel also returns max|dx| of the values it stored (the amax of dx's FP8 cast as the next
    linear's output gradient), exactly, since a max is the same in any order; dx and dw are unchanged."""
    if DEV == "cpu" and not interpreted(R._bwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    x, w = _inputs(m, h)
    x8, xs, rstd = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, g)[:3]
    dy = torch.randn(m, h, device=DEV).to(torch.bfloat16)
    res = (torch.randn(m, h, device=DEV) * 4).to(torch.bfloat16) if residual else None
    for bwd in (R.rmsnorm_fp8_bwd_ref, R.rmsnorm_fp8_bwd_triton):
        dx, dw, amax = bwd(dy, x8, xs, rstd, w, g, residual_grad=res, dx_amax=True)
        assert amax.dtype == torch.float32 and amax.shape == (1,)
        assert amax.item() == dx.float().abs().max().item() > 0
        dx0, dw0 = bwd(dy, x8, xs, rstd, w, g, residual_grad=res)
        assert torch.equal(dx, dx0) and torch.equal(dw, dw0)
    assert len(R.rmsnorm_fp8_bwd(dy, x8, xs, rstd, w, g, residual_grad=res)) == 2  # the dispatcher too
    assert len(R.rmsnorm_fp8_bwd(dy, x8, xs, rstd, w, g, residual_grad=res, dx_amax=True)) == 3


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_add_norms_the_sum_and_returns_it(backend):
    """add: h = x + add exactly as torch adds (fp32 sum, one rounding to bf16; the CPU interpreter truncates its
    bf16 casts instead, so there within one bf16 step), and every output that of the norm of that h by the same
    backend, byte for byte; delayed scaling too."""
    if backend == "triton" and DEV == "cpu" and not interpreted(R._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    fwd, delayed = ((R.rmsnorm_fp8_fwd_ref, R.rmsnorm_fp8_fwd_delayed_ref) if backend == "ref" else
                    (R.rmsnorm_fp8_fwd_triton, R.rmsnorm_fp8_fwd_delayed_triton))
    m, h, g = SHAPES[0]
    x, w = _inputs(m, h)
    add = (torch.randn(m, h, device=DEV) * 2).to(torch.bfloat16)
    want_h = x + add
    exact = backend == "ref" or DEV == "cuda"

    def is_sum(out):
        if len(out) != 6:
            return False
        if exact:
            return same_bytes(out[5], want_h)
        return bool(((out[5].float() - want_h.float()).abs() <= 2 ** -7 * want_h.float().abs()).all())
    got = fwd(x, w, 1e-5, g, add=add)
    assert is_sum(got)
    assert all(same_bytes(a, b) for a, b in zip(got[:5], fwd(got[5], w, 1e-5, g)))
    hist_a, hist_b = (torch.full((4,), 3.0, device=DEV) for _ in range(2))
    got = delayed(x, w, hist_a, 1e-5, g, add=add)
    assert is_sum(got)
    assert all(same_bytes(a, b) for a, b in zip(got[:5], delayed(got[5], w, hist_b, 1e-5, g)))
    assert torch.equal(hist_a, hist_b)


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
    x8, xs, rstd, ys, y8 = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 64)
    assert same_bytes(y8, R.rmsnorm_fp8_out_ref(x8, xs, rstd, w, ys, 64, transpose=False))
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    # two casts (the input per group, the output per tensor), each at most U relative on normal values
    assert rel_err(y8.float() * ys, want) <= 2 * U
    assert rel_err(group_dequantize(x8, xs, 64), xf) <= U


def test_backward_reference_is_the_gradient():
    """On the dequantized input (exactly what backward sees) the formula equals autograd in fp32."""
    x, w = _inputs(32, 192)
    x8, xs, rstd = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 128)[:3]
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
    with pytest.raises(ValueError, match="add must be x's shape and dtype"):
        R.rmsnorm_fp8_fwd(torch.randn(4, 16), torch.ones(16), 1e-5, 16, add=torch.randn(4, 8))


@pytest.mark.gpu
def test_gpu_large_shape_matches_reference():
    """Llama-2-7B's norm at 2048 tokens: one row per forward program (2048 programs fold the output's amax, the
    second launch derives the scale), a persistent backward grid with many rows per program (each folding its
    share of dx's amax)."""
    x, w = _inputs(2048, 4096)
    ta, ra = R.rmsnorm_fp8_fwd_triton(x, w, 1e-5, 128), R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, 128)
    assert_fp8_close(ta[0], ra[0])
    assert_close_f32(ta[1], ra[1])
    assert_close_f32(ta[2], ra[2], rtol=1e-5, atol=0)
    assert_close_f32(ta[3], ra[3], rtol=1e-5, atol=0)
    assert_fp8_close(ta[4], ra[4])
    assert same_bytes(ta[4], R.rmsnorm_fp8_out_triton(*ta[:3], w, ta[3], 128, False))
    assert_fp8_close(R.rmsnorm_fp8_out_triton(*ra[:3], w, ra[3], 128, True),
                     R.rmsnorm_fp8_out_ref(*ra[:3], w, ra[3], 128, True))
    dy = torch.randn(2048, 4096, device=DEV).to(torch.bfloat16)
    (tdx, tdw), (rdx, rdw) = (R.rmsnorm_fp8_bwd_triton(dy, *ra[:3], w, 128), R.rmsnorm_fp8_bwd_ref(dy, *ra[:3], w, 128))
    assert_close_f32(tdx, rdx, rtol=1e-2, atol=1e-2)
    assert_close_f32(tdw, rdw, rtol=1e-4, atol=1e-3)  # fp32 sums over 2048 rows in another order
    res = torch.randn(2048, 4096, device=DEV).to(torch.bfloat16)
    tdx, tdw2 = R.rmsnorm_fp8_bwd_triton(dy, *ra[:3], w, 128, residual_grad=res)
    assert_close_f32(tdx, R.rmsnorm_fp8_bwd_ref(dy, *ra[:3], w, 128, residual_grad=res)[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(tdw2, tdw)  # dw does not see the residual
    tdx3, _, amax = R.rmsnorm_fp8_bwd_triton(dy, *ra[:3], w, 128, residual_grad=res, dx_amax=True)
    assert torch.equal(tdx3, tdx) and amax.item() == tdx.float().abs().max().item()  # every program's max folded


# --- delayed scaling of the output (--fp8-activation-scaling delayed) --------------------------------------------
_same = same_bytes


def _fwd_both(backend, x, w, g):
    """(delayed(history, bootstrap), current()) forward of one backend on x; current = rmsnorm_fp8_fwd."""
    fwd, delayed = ((R.rmsnorm_fp8_fwd_ref, R.rmsnorm_fp8_fwd_delayed_ref) if backend == "ref" else
                    (R.rmsnorm_fp8_fwd_triton, R.rmsnorm_fp8_fwd_delayed_triton))
    return (lambda history, bootstrap=False: delayed(x, w, history, 1e-5, g, bootstrap=bootstrap),
            lambda: fwd(x, w, 1e-5, g))


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_delayed_meets_current_scaling_where_the_amax_repeats(backend):
    """The bootstrap call and a call on the same input write current scaling's bytes (fp8_compare's helper)."""
    if backend == "triton" and DEV == "cpu" and not interpreted(R._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    m, h, g = SHAPES[0]
    assert_delayed_meets_current(*_fwd_both(backend, *_inputs(m, h), g), 3, E4M3.dtype)


def test_delayed_scale_is_the_history_max_and_saturates():
    m, h, g = SHAPES[1]
    x, w = _inputs(m, h)
    x8, xs, rstd, own = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, g)[:4]

    def run(history):
        *saved, y_scale, y8 = R.rmsnorm_fp8_fwd_delayed_ref(x, w, history, 1e-5, g)
        assert all(_same(a, b) for a, b in zip(saved, (x8, xs, rstd)))  # the saved input is scaling's own
        return y_scale, y8
    amax = own.item() * torch.finfo(E4M3.dtype).max  # the scale is amax / fmax (amax above the floor)
    assert_delayed_scale_and_saturation(run, lambda scale: R.rmsnorm_fp8_out_ref(x8, xs, rstd, w, scale, g, False),
                                        amax, E4M3.dtype)


@pytest.mark.parametrize("hist_len", [1, 5, 16, 17])
def test_delayed_triton_matches_reference(hist_len):
    """Any history length (padded to a power of two in the kernel), two calls in a row (the second scales by what
    the first recorded): the scale bit for bit, y as _out_kernel writes it, the history rolled as the reference's."""
    if DEV == "cpu" and not interpreted(R._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    m, h, g = SHAPES[0]
    x, w = _inputs(m, h)
    amax = R.rmsnorm_fp8_fwd_ref(x, w, 1e-5, g)[3].item() * torch.finfo(E4M3.dtype).max
    start = [0.5 * amax * (k + 1) / hist_len for k in range(hist_len)]
    h_ref, h_tri = (torch.tensor(start, device=DEV) for _ in range(2))
    for xi in (x, 2 * x):
        before = h_tri.clone()
        want = R.rmsnorm_fp8_fwd_delayed_ref(xi, w, h_ref, 1e-5, g)
        got = R.rmsnorm_fp8_fwd_delayed_triton(xi, w, h_tri, 1e-5, g)
        assert _same(got[3], R.scale_from_amax(before.amax().reshape(1), E4M3.dtype))  # the history's, exactly
        assert_fp8_close(got[0], want[0])
        # y: _out_kernel's bytes from the same x8, rstd and scale (under the interpreter rstd and the casts
        # differ from torch's, so the reference's y is only compared on CUDA)
        assert _same(got[4], R.rmsnorm_fp8_out_triton(*got[:3], w, got[3], g, False))
        if DEV == "cuda":
            assert _same(got[3], want[3])
            assert_fp8_close(got[4], want[4])
        assert torch.equal(h_tri[1:], before[:-1])  # rolled, not recomputed
        tol = 1e-5 if DEV == "cuda" else 2e-2  # the recorded amax reads rstd (see test_triton_matches_reference)
        assert_close_f32(h_tri[0], h_ref[0], rtol=tol, atol=0)


@pytest.mark.gpu
def test_gpu_delayed_at_the_7b_shape():
    """Llama-2-7B's norm at 2048 tokens with delayed scaling: where the history holds the call's own amax (the
    bootstrap call's record), one launch writes current scaling's bytes; a history of half that amax saturates."""
    delayed, current = _fwd_both("triton", *_inputs(2048, 4096), 128)
    history, _ = assert_delayed_meets_current(delayed, current, 3, E4M3.dtype, history_len=16)
    history[:] = 0.5 * history[0]
    assert (delayed(history)[4].float().abs() == torch.finfo(E4M3.dtype).max).any()
