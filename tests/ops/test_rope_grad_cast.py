"""The [q|k|v] gradient's RoPE backward, join, amax and FP8 cast: Triton against the reference (the unfused path), the
reference against fp32 autograd through the model's RoPE, and the layouts' agreement."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, assert_fp8_close, interpreted, rel_err  # noqa: I001
from megacoat.fp8.formats import E4M3, E5M2
from megacoat.model.gpt import apply_rope, rope_tables
from megacoat.ops import rope, rope_grad_cast as R

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
