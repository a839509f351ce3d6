"""The [q|k|v] gradient's RoPE backward, join, amax and FP8 cast: Triton against the reference (the unfused path), the
reference against fp32 autograd through the model's RoPE, and the layouts' agreement."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, assert_fp8_close, interpreted, rel_err  # noqa: I001
from megacoat.ops.formats import E4M3, E5M2
from megacoat.model.gpt import apply_rope, rope_tables
from megacoat.ops import rope, rope_grad_cast as R
from megacoat.ops.numerics import scale_from_amax

FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def _grads(b, s, hq, hk, d, dtype=torch.float32):
    """dq, dk, dv as attention's backward returns them: [b, s, heads, d] views of [b, heads, s, d] tensors."""
    mk = lambda h: torch.randn(b, h, s, d, device=DEV).to(dtype).transpose(1, 2)  # noqa: E731
    return mk(hq), mk(hk), mk(hk)


def _skip_unless_kernels_run():
    if DEV == "cpu" and not interpreted(rope._rope_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")


# grouped-query heads; a head dim of 24 (not a power of two: masked lanes in RoPE's kernel); 40 tokens of 128 (the
# cast's last 64-row tile cut short)
@pytest.mark.parametrize("b,s,hq,hk,d", [(2, 24, 4, 2, 32), (1, 32, 3, 3, 24), (2, 20, 2, 1, 128)])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_triton_matches_reference(b, s, hq, hk, d, grad_dtype):
    """fp32 gradients: the rotation is the reference's float32 arithmetic, so the amax, and with it the scale, is
    the same float; the FP8 codes then agree as the casts of megacoat.ops.cast_transpose do (fp8_compare)."""
    _skip_unless_kernels_run()
    dq, dk, dv = _grads(b, s, hq, hk, d)
    cos, sin = (t.to(DEV) for t in rope_tables(d, s, 10000.0))
    g8, g8t, scale = R.rope_qkv_grad_fp8_triton(dq, dk, dv, cos, sin, grad_dtype)
    r8, r8t, rscale = R.rope_qkv_grad_fp8_ref(dq, dk, dv, cos, sin, grad_dtype)
    assert g8.shape == (b * s, (hq + 2 * hk) * d) and g8t.shape == g8.shape[::-1]
    torch.testing.assert_close(scale, rscale, rtol=0 if DEV == "cpu" else 2 ** -22, atol=0)  # GPU: FMA contraction
    assert_fp8_close(g8, r8)
    assert torch.equal(g8t.view(torch.uint8), g8.t().view(torch.uint8))  # both layouts from one tile, bit for bit


def test_bf16_gradients_round_like_the_unfused_path():
    """bf16 gradients: the rotation rounds to bf16 before the amax, as RoPE's backward stores it. On CUDA the
    codes agree as the casts do. The interpreter truncates float32 to bf16 (one bf16 ulp, at most 2^-7 relative,
    below round-to-nearest), so there the scale may move by that much, and its FP8 casts put values just under a
    power of two one binade low (fp8_compare): the dequantized tensors are held to fp8_compare's CPU bound."""
    _skip_unless_kernels_run()
    dq, dk, dv = _grads(2, 24, 4, 2, 32, torch.bfloat16)
    cos, sin = (t.to(DEV) for t in rope_tables(32, 24, 10000.0))
    for grad_dtype in FORMATS:
        g8, _, scale = R.rope_qkv_grad_fp8_triton(dq, dk, dv, cos, sin, grad_dtype)
        r8, _, rscale = R.rope_qkv_grad_fp8_ref(dq, dk, dv, cos, sin, grad_dtype)
        if DEV == "cuda":
            torch.testing.assert_close(scale, rscale, rtol=2 ** -22, atol=0)
            assert_fp8_close(g8, r8)
        else:
            torch.testing.assert_close(scale, rscale, rtol=2 ** -7, atol=0)
            assert rel_err(g8.float() * scale, r8.float() * rscale) <= 0.15


@pytest.mark.parametrize("grad_dtype", list(FORMATS))
def test_reference_is_the_quantized_gradient_of_qkv(grad_dtype):
    """Dequantized, the reference is the fp32 gradient of [q|k|v] through the model's RoPE (autograd), within
    the rounding of the stored bf16 gradients (2^-8) and of the FP8 cast (the format's unit roundoff)."""
    b, s, hq, hk, d = 2, 16, 4, 2, 32
    cos, sin = rope_tables(d, s, 10000.0)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, requires_grad=True)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    outs = (apply_rope(q.reshape(b, s, hq, d), cos, sin), apply_rope(k.reshape(b, s, hk, d), cos, sin),
            v.reshape(b, s, hk, d))
    dys = [torch.randn(t.shape).bfloat16() for t in outs]
    torch.autograd.backward(outs, [dy.float() for dy in dys])
    g8, g8t, scale = R.rope_qkv_grad_fp8_ref(*dys, cos, sin, grad_dtype)
    assert rel_err(g8.float() * scale, qkv.grad.reshape(b * s, -1)) <= FORMATS[grad_dtype].unit_roundoff + 2 ** -8
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))


def test_mismatched_inputs_are_named():
    dq, dk, dv = _grads(1, 8, 2, 2, 16)
    cos, sin = rope_tables(16, 8, 10000.0)
    with pytest.raises(ValueError, match="dv must be"):
        R.rope_qkv_grad_fp8(dq, dk, dv[:, :4], cos, sin, torch.float8_e5m2)
    with pytest.raises(ValueError, match="do not cover"):
        R.rope_qkv_grad_fp8(dq, dk, dv, cos[:4], sin[:4], torch.float8_e5m2)


def _same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("b,s,hq,hk,d", [(2, 24, 4, 2, 32), (1, 32, 3, 3, 24)])
def test_delayed_meets_current_where_the_amax_repeats(backend, b, s, hq, hk, d):
    """Delayed scaling: the first call (bootstrap) is the current path and records its amax; a call whose history
    holds its own amax writes the current path's bytes (both layouts, the scale) in one pass; a larger gradient
    saturates at the recorded scale, and the history rolls with each call's amax in front."""
    if backend == "triton":
        _skip_unless_kernels_run()
    delayed = R.rope_qkv_grad_fp8_delayed_ref if backend == "ref" else R.rope_qkv_grad_fp8_delayed_triton
    current = R.rope_qkv_grad_fp8_ref if backend == "ref" else R.rope_qkv_grad_fp8_triton
    dq, dk, dv = _grads(b, s, hq, hk, d, torch.bfloat16)
    cos, sin = (t.to(DEV) for t in rope_tables(d, s, 10000.0))
    history = torch.zeros(4, device=DEV)
    cur = current(dq, dk, dv, cos, sin, torch.float8_e5m2)
    first = delayed(dq, dk, dv, cos, sin, torch.float8_e5m2, history, bootstrap=True)
    assert all(_same(x, y) for x, y in zip(first, cur))
    amax = history[0].item()
    assert torch.equal(scale_from_amax(history[:1], torch.float8_e5m2), cur[2]) and history[1:].eq(0).all()
    again = delayed(dq, dk, dv, cos, sin, torch.float8_e5m2, history)  # the history holds this call's amax
    assert all(_same(x, y) for x, y in zip(again, cur))
    assert _same(again[1], again[0].t().contiguous())
    assert history[:2].tolist() == [amax, amax]
    big = delayed(*(4 * t for t in (dq, dk, dv)), cos, sin, torch.float8_e5m2, history)
    assert torch.equal(big[2], cur[2])  # the recorded scale, not this call's
    fmax = torch.finfo(torch.float8_e5m2).max
    assert big[0].float().abs().max().item() == fmax  # values beyond it saturate, never inf
    assert history[0].item() == 4 * amax and history[1:3].tolist() == [amax, amax]


def test_delayed_triton_matches_the_reference_with_a_history():
    """A history from other calls (scale unrelated to this call's amax): the kernel's codes are the reference's, as the
    current path's are (fp32 gradients: the same float32 arithmetic), and both roll the same amax in."""
    _skip_unless_kernels_run()
    dq, dk, dv = _grads(2, 20, 2, 1, 128)
    cos, sin = (t.to(DEV) for t in rope_tables(128, 20, 10000.0))
    hists = [torch.tensor([0.0, 3.0, 1.5], device=DEV) for _ in range(2)]
    t8, t8t, tscale = R.rope_qkv_grad_fp8_delayed_triton(dq, dk, dv, cos, sin, torch.float8_e4m3fn, hists[0])
    r8, r8t, rscale = R.rope_qkv_grad_fp8_delayed_ref(dq, dk, dv, cos, sin, torch.float8_e4m3fn, hists[1])
    assert torch.equal(tscale, rscale)
    assert_fp8_close(t8, r8)
    assert _same(t8t, t8.t().contiguous())
    torch.testing.assert_close(hists[0], hists[1], rtol=0 if DEV == "cpu" else 2 ** -22, atol=0)
    assert hists[0][1:].tolist() == [0.0, 3.0]


@pytest.mark.gpu
def test_gpu_llama_7b_shape_matches_reference():
    """Llama-2-7B attention at 2048 tokens (32 heads of 128), bf16 gradients as attention's backward leaves them."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    dq, dk, dv = _grads(1, 2048, 32, 32, 128, torch.bfloat16)
    cos, sin = (t.to(DEV) for t in rope_tables(128, 2048, 10000.0))
    g8, g8t, scale = R.rope_qkv_grad_fp8(dq, dk, dv, cos, sin, torch.float8_e5m2)
    r8, r8t, rscale = R.rope_qkv_grad_fp8_ref(dq, dk, dv, cos, sin, torch.float8_e5m2)
    torch.testing.assert_close(scale, rscale, rtol=2 ** -22, atol=0)
    assert_fp8_close(g8, r8)
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
    # delayed scaling: with the history holding this call's amax, the one-pass path writes the current path's bytes
    history = torch.zeros(16, device=DEV)
    R.rope_qkv_grad_fp8_delayed(dq, dk, dv, cos, sin, torch.float8_e5m2, history, bootstrap=True)
    d8, d8t, dscale = R.rope_qkv_grad_fp8_delayed(dq, dk, dv, cos, sin, torch.float8_e5m2, history)
    assert torch.equal(dscale, scale) and _same(d8, g8) and _same(d8t, g8t)
