"""Fused FP8 SwiGLU: Triton against its torch reference, and the reference against fp32 silu(a1) * a3."""
import pytest
import torch

from tests.ops.fp8_compare import (DEV, assert_close_f32, assert_delayed_meets_current,
                                   assert_delayed_scale_and_saturation, assert_fp8_close,  # noqa: I001
                                   interpreted, rel_err, same_bytes)
from megacoat.ops.formats import E4M3, E5M2
from megacoat.ops import swiglu as S
from megacoat.ops.numerics import group_dequantize

U4, U5 = E4M3.unit_roundoff, E5M2.unit_roundoff  # 2^-4, 2^-3
SHAPES = [(40, 200, 128), (33, 256, 64)]


def _a13(m, f):
    return (torch.randn(m, 2 * f, device=DEV) * 2).to(torch.bfloat16)


def _saved_pair_and_grad(m, f, g):
    """The forward's saved outputs (reference: the pair and s's scale) and a bf16 output gradient ds [M, F]."""
    return S.swiglu_fp8_fwd_ref(_a13(m, f), g)[:5], torch.randn(m, f, device=DEV).to(torch.bfloat16)


@pytest.mark.parametrize("m,f,g", SHAPES)
def test_triton_matches_reference(m, f, g):
    if DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    a13 = _a13(m, f)
    ta, ra = S.swiglu_fp8_fwd_triton(a13, g), S.swiglu_fp8_fwd_ref(a13, g)
    assert_fp8_close(ta[0], ra[0])
    assert_fp8_close(ta[2], ra[2])
    assert_close_f32(ta[1], ra[1])
    assert_close_f32(ta[3], ra[3])
    assert_close_f32(ta[4], ra[4], rtol=1e-5 if DEV == "cuda" else 0.1, atol=0)
    # s: the second launch derives the scale from the folded amax; the bytes of a launch given that scale
    assert same_bytes(ta[5], S.swiglu_fp8_out_triton(*ta[:5], g, False))
    if DEV == "cuda":
        assert_fp8_close(ta[5], ra[5])
    for transpose in (False, True):
        assert_fp8_close(S.swiglu_fp8_out_triton(*ra[:5], g, transpose), S.swiglu_fp8_out_ref(*ra[:5], g, transpose))
    ds = torch.randn(m, f, device=DEV).to(torch.bfloat16)
    tb, rb = S.swiglu_fp8_bwd_triton(ds, *ra[:4], g), S.swiglu_fp8_bwd_ref(ds, *ra[:4], g)
    assert_close_f32(tb[2], rb[2], rtol=1e-5, atol=0)
    assert_fp8_close(tb[0], rb[0])
    assert_fp8_close(tb[1], rb[1])


@pytest.mark.parametrize("m,f,g", SHAPES)
def test_backward_with_out_t_is_both_calls(m, f, g):
    """swiglu_fp8_bwd_out_t writes s^T in the amax pass: the same bytes as swiglu_fp8_out(transpose=True)."""
    if DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    ra, ds = _saved_pair_and_grad(m, f, g)
    da, dat, scale, st = S.swiglu_fp8_bwd_out_t_triton(ds, *ra, g)
    assert torch.equal(st.view(torch.uint8), S.swiglu_fp8_out_triton(*ra, g, True).view(torch.uint8))
    for got, want in zip((da, dat, scale), S.swiglu_fp8_bwd_triton(ds, *ra[:4], g)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    want = S.swiglu_fp8_bwd_out_t_ref(ds, *ra, g)
    assert_fp8_close(st, want[3])
    assert_fp8_close(da, want[0])


def test_zero_gradient_is_zero_not_nan():
    """An all-zero ds floors the scale at tiny / fmax, whose reciprocal overflows: the cast must divide then."""
    if DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    ra = S.swiglu_fp8_fwd_ref(_a13(16, 64), 16)
    da, dat, scale = S.swiglu_fp8_bwd_triton(torch.zeros(16, 64, device=DEV, dtype=torch.bfloat16), *ra[:4], 16)
    assert scale.item() == S.swiglu_fp8_bwd_ref(torch.zeros(16, 64, device=DEV), *ra[:4], 16)[2].item() > 0
    assert not da.float().isnan().any() and (da.float() == 0).all() and (dat.float() == 0).all()


def test_reference_against_fp32():
    a13 = _a13(64, 256)
    a1_8, s1, a3_8, s3, ss, s8 = S.swiglu_fp8_fwd_ref(a13, 64)
    assert same_bytes(s8, S.swiglu_fp8_out_ref(a1_8, s1, a3_8, s3, ss, 64, transpose=False))
    a1, a3 = a13.float().chunk(2, dim=1)
    want = torch.nn.functional.silu(a1) * a3
    got = s8.float() * ss
    assert rel_err(got, want) <= 3 * U4  # a1, a3 and the output: three E4M3 casts


def test_backward_reference_is_the_gradient():
    a13 = _a13(32, 128)
    a1_8, s1, a3_8, s3 = S.swiglu_fp8_fwd_ref(a13, 32)[:4]
    a1 = group_dequantize(a1_8, s1, 32).requires_grad_()
    a3 = group_dequantize(a3_8, s3, 32).requires_grad_()
    ds = torch.randn(32, 128, device=DEV)
    (torch.nn.functional.silu(a1) * a3).backward(ds)
    da, dat, scale = S.swiglu_fp8_bwd_ref(ds, a1_8, s1, a3_8, s3, 32)
    want = torch.cat((a1.grad, a3.grad), dim=1)
    assert da.dtype == torch.float8_e5m2
    assert rel_err(da.float() * scale, want) <= U5  # one E5M2 cast
    assert torch.equal(dat, da.t().contiguous())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="a13"):
        S.swiglu_fp8_fwd(torch.randn(4, 15), 16)


@pytest.mark.gpu
def test_gpu_large_shape_matches_reference():
    a13 = _a13(2048, 11008)
    ta, ra = S.swiglu_fp8_fwd_triton(a13, 128), S.swiglu_fp8_fwd_ref(a13, 128)
    assert_fp8_close(ta[0], ra[0])
    assert_close_f32(ta[4], ra[4], rtol=1e-5, atol=0)
    assert_fp8_close(ta[5], ra[5])
    assert same_bytes(ta[5], S.swiglu_fp8_out_triton(*ta[:5], 128, False))
    assert_fp8_close(S.swiglu_fp8_out_triton(*ra[:5], 128, True), S.swiglu_fp8_out_ref(*ra[:5], 128, True))
    ds = torch.randn(2048, 11008, device=DEV).to(torch.bfloat16)
    tb, rb = S.swiglu_fp8_bwd_triton(ds, *ra[:4], 128), S.swiglu_fp8_bwd_ref(ds, *ra[:4], 128)
    assert_close_f32(tb[2], rb[2], rtol=1e-5, atol=0)
    assert_fp8_close(tb[0], rb[0])
    assert_fp8_close(tb[1], rb[1])


# --- delayed scaling (--fp8-grad-scaling delayed) -----------------------------------------------------------------
_same = same_bytes


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_delayed_bootstrap_is_current_scaling(backend):
    """The first call (no history yet) scales by its own amax: exactly swiglu_fp8_bwd_out_t, and it records that
    amax in front of the history."""
    if backend == "triton" and DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    delayed, current = ((S.swiglu_fp8_bwd_delayed_ref, S.swiglu_fp8_bwd_out_t_ref) if backend == "ref" else
                        (S.swiglu_fp8_bwd_delayed_triton, S.swiglu_fp8_bwd_out_t_triton))
    m, f, g = SHAPES[0]
    ra, ds = _saved_pair_and_grad(m, f, g)
    history = torch.tensor([0.0, 0.0, 0.0], device=DEV)
    got = delayed(ds, *ra, history, g, bootstrap=True)
    assert all(_same(a, b) for a, b in zip(got, current(ds, *ra, g)))
    # the scale is max(amax, floor) / F.max of the recorded amax, so the recorded amax is the one the cast used
    assert _same(got[2], S.scale_from_amax(history[:1], E5M2.dtype)) and history[1:].eq(0).all()


def test_delayed_scale_is_the_history_max_and_saturates():
    m, f, g = SHAPES[1]
    ra, ds = _saved_pair_and_grad(m, f, g)
    da = S._da_ref(ds, *ra[:4], g)
    amax = da.abs().amax().item()
    fmax = torch.finfo(E5M2.dtype).max
    for hist in ([amax * 4, 0.5 * amax, 0.0], [0.25 * amax, 0.125 * amax, 0.0]):  # headroom, then overflow
        history = torch.tensor(hist, device=DEV)
        q, qt, scale, st = S.swiglu_fp8_bwd_delayed_ref(ds, *ra, history, g)
        want_scale = S.scale_from_amax(torch.tensor([max(hist)], device=DEV), E5M2.dtype)
        assert _same(scale, want_scale)
        assert _same(q, (da / want_scale).clamp(-fmax, fmax).to(E5M2.dtype)) and _same(qt, q.t().contiguous())
        assert _same(st, S.swiglu_fp8_out_ref(*ra, g, True))
        saturated = (q.float().abs() == fmax).float().mean().item()
        assert (saturated > 0) == (max(hist) < amax)  # beyond the history's amax, values clamp to F.max
        assert history[0].item() == amax and torch.equal(history[1:], torch.tensor(hist[:-1], device=DEV))


def test_delayed_records_a_non_finite_amax_as_zero():
    m, f, g = SHAPES[1]
    ra, ds = _saved_pair_and_grad(m, f, g)
    ds[3, 5] = float("inf")
    history = torch.tensor([2.0, 1.0], device=DEV)
    S.swiglu_fp8_bwd_delayed_ref(ds, *ra, history, g)
    assert history.tolist() == [0.0, 2.0]


@pytest.mark.parametrize("m,f,g", SHAPES)
def test_delayed_triton_matches_reference(m, f, g):
    """One pass (no amax pass): the cast as the reference's, s^T as swiglu_fp8_out's bytes, the same history."""
    if DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    ra, ds = _saved_pair_and_grad(m, f, g)
    amax = S._da_ref(ds, *ra[:4], g).abs().amax().item()
    h_ref, h_tri = (torch.tensor([0.5 * amax, 0.9 * amax, 0.0], device=DEV) for _ in range(2))
    want = S.swiglu_fp8_bwd_delayed_ref(ds, *ra, h_ref, g)
    got = S.swiglu_fp8_bwd_delayed_triton(ds, *ra, h_tri, g)
    assert _same(got[2], want[2])  # the scale from the history alone: bit for bit
    assert_fp8_close(got[0], want[0])
    assert _same(got[1], got[0].t().contiguous())
    assert _same(got[3], S.swiglu_fp8_out_triton(*ra, g, True))
    assert_close_f32(h_tri, h_ref, rtol=1e-5 if DEV == "cuda" else 0.1, atol=0)
    assert torch.equal(h_tri[1:], h_ref[1:])  # rolled, not recomputed


@pytest.mark.parametrize("hist_len", [1, 5, 16, 17])
def test_delayed_triton_rolls_the_history_in_the_kernel(hist_len):
    """The kernel's last program rolls the history: any length (the kernel pads to a power of two), two calls in
    a row (the second scales by what the first recorded), and a non-finite amax recorded as zero."""
    if DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    m, f, g = SHAPES[1]
    ra, ds = _saved_pair_and_grad(m, f, g)
    amax = S._da_ref(ds, *ra[:4], g).abs().amax().item()
    start = [0.5 * amax * (k + 1) / hist_len for k in range(hist_len)]
    h_ref, h_tri = (torch.tensor(start, device=DEV) for _ in range(2))
    for ds_call in (ds, 2 * ds):  # the second call's scale comes from the first call's record
        want = S.swiglu_fp8_bwd_delayed_ref(ds_call, *ra, h_ref, g)
        got = S.swiglu_fp8_bwd_delayed_triton(ds_call, *ra, h_tri, g)
        assert _same(got[2], want[2])
        assert_fp8_close(got[0], want[0])
        assert_close_f32(h_tri, h_ref, rtol=1e-5 if DEV == "cuda" else 0.1, atol=0)
        assert torch.equal(h_tri[1:], h_ref[1:])
    bad = ds.clone()
    bad[3, 5] = float("inf")
    S.swiglu_fp8_bwd_delayed_triton(bad, *ra, h_tri, g)
    S.swiglu_fp8_bwd_delayed_ref(bad, *ra, h_ref, g)
    assert h_tri[0].item() == 0.0 and torch.equal(h_tri, h_ref)


# --- delayed scaling of the forward's output (--fp8-activation-scaling delayed) ----------------------------------
def _fwd_both(backend, a13, g):
    """(delayed(history, bootstrap), current()) forward of one backend on a13; current = swiglu_fp8_fwd."""
    fwd, delayed = ((S.swiglu_fp8_fwd_ref, S.swiglu_fp8_fwd_delayed_ref) if backend == "ref" else
                    (S.swiglu_fp8_fwd_triton, S.swiglu_fp8_fwd_delayed_triton))
    return lambda history, bootstrap=False: delayed(a13, history, g, bootstrap=bootstrap), lambda: fwd(a13, g)


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_delayed_forward_meets_current_scaling_where_the_amax_repeats(backend):
    """The bootstrap call and a call on the same input write current scaling's bytes (fp8_compare's helper)."""
    if backend == "triton" and DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    m, f, g = SHAPES[0]
    assert_delayed_meets_current(*_fwd_both(backend, _a13(m, f), g), 4, E4M3.dtype)


def test_delayed_forward_scale_is_the_history_max_and_saturates():
    m, f, g = SHAPES[1]
    a13 = _a13(m, f)
    saved = S.swiglu_fp8_fwd_ref(a13, g)

    def run(history):
        *pair, s_scale, s8 = S.swiglu_fp8_fwd_delayed_ref(a13, history, g)
        assert all(_same(a, b) for a, b in zip(pair, saved[:4]))  # the saved pair is scaling's own
        return s_scale, s8
    amax = saved[4].item() * torch.finfo(E4M3.dtype).max  # the scale is amax / fmax (amax above the floor)
    assert_delayed_scale_and_saturation(run, lambda scale: S.swiglu_fp8_out_ref(*saved[:4], scale, g, False), amax,
                                        E4M3.dtype)


@pytest.mark.parametrize("hist_len", [1, 5, 16, 17])
def test_delayed_forward_triton_matches_reference(hist_len):
    """Any history length (padded to a power of two in the kernel), two calls in a row (the second scales by what
    the first recorded): the scale bit for bit, s as _out_kernel writes it, the history rolled as the reference's."""
    if DEV == "cpu" and not interpreted(S._fwd_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    m, f, g = SHAPES[1]
    a13 = _a13(m, f)
    amax = S.swiglu_fp8_fwd_ref(a13, g)[4].item() * torch.finfo(E4M3.dtype).max
    start = [0.5 * amax * (k + 1) / hist_len for k in range(hist_len)]
    h_ref, h_tri = (torch.tensor(start, device=DEV) for _ in range(2))
    for x in (a13, 2 * a13):
        before = h_tri.clone()
        want = S.swiglu_fp8_fwd_delayed_ref(x, h_ref, g)
        got = S.swiglu_fp8_fwd_delayed_triton(x, h_tri, g)
        assert _same(got[4], S.scale_from_amax(before.amax().reshape(1), E4M3.dtype))  # the history's, exactly
        assert_fp8_close(got[0], want[0])
        assert_fp8_close(got[2], want[2])
        # s: _out_kernel's bytes from the same pair and scale (the interpreter's casts differ from torch's, and
        # compound over the pair and s, so the reference's s is only compared on CUDA)
        assert _same(got[5], S.swiglu_fp8_out_triton(*got[:5], g, False))
        if DEV == "cuda":
            assert _same(got[4], want[4])
            assert_fp8_close(got[5], want[5])
        assert torch.equal(h_tri[1:], before[:-1])  # rolled, not recomputed
        assert_close_f32(h_tri[0], h_ref[0], rtol=1e-5 if DEV == "cuda" else 0.1, atol=0)


@pytest.mark.gpu
def test_gpu_delayed_at_the_7b_shape():
    """Llama-2-7B's SwiGLU at 2048 tokens, forward and backward with delayed scaling: where the history holds the
    call's own amax (the bootstrap call's record), one launch writes current scaling's bytes; a history of half that
    amax saturates, and the roll kernel puts the call's amax in front."""
    m, f, g = 2048, 11008, 128
    delayed, current = _fwd_both("triton", _a13(m, f), g)
    history, want = assert_delayed_meets_current(delayed, current, 4, E4M3.dtype, history_len=16)
    history[:] = 0.5 * history[0]
    assert (delayed(history)[5].float().abs() == torch.finfo(E4M3.dtype).max).any()
    ds = torch.randn(m, f, device=DEV).to(torch.bfloat16)
    grad_history = torch.zeros(16, device=DEV)
    bwd = S.swiglu_fp8_bwd_delayed_triton(ds, *want[:5], grad_history, g, bootstrap=True)
    assert all(_same(a, b) for a, b in zip(bwd, S.swiglu_fp8_bwd_out_t_triton(ds, *want[:5], g)))
    again = S.swiglu_fp8_bwd_delayed_triton(ds, *want[:5], grad_history, g)
    assert all(_same(a, b) for a, b in zip(again, bwd)) and grad_history[0] == grad_history[1] > 0
