"""RoPE kernel: Triton against the reference, the reference against the model's apply_rope, its inverse against
apply_rope's gradient (the backward that megacoat.ops.rope_grad_cast fuses)."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, interpreted  # noqa: I001
from megacoat.model.gpt import apply_rope, rope_tables
from megacoat.ops import rope as R


def _qkv(b=2, s=24, nh=3, d=32):
    """q as a column slice of a fused [q|k|v] output, as the COAT block passes it."""
    qkv = torch.randn(b, s, 3 * nh * d, device=DEV)
    return qkv[..., : nh * d].view(b, s, nh, d)


@pytest.mark.parametrize("nh,d", [(3, 32), (3, 24), (40, 128)])  # 40 x 128: two head blocks, the last partial
def test_triton_matches_reference(nh, d):
    if DEV == "cpu" and not interpreted(R._rope_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    q = _qkv(s=24 if nh < 8 else 3, nh=nh, d=d)
    cos, sin = (t.to(DEV) for t in rope_tables(d, 32, 10000.0))
    torch.testing.assert_close(R.rope_triton(q, cos, sin), R.rope_ref(q, cos, sin), rtol=1e-5, atol=1e-5)


def test_reference_is_the_models_rope_and_its_inverse_is_the_gradient():
    q = _qkv().cpu().requires_grad_()
    cos, sin = rope_tables(32, 32, 10000.0)
    torch.testing.assert_close(R.rope_rotate(q, cos, sin), apply_rope(q, cos, sin), rtol=0, atol=0)
    dy = torch.randn(q.shape)
    want = torch.autograd.grad(apply_rope(q, cos, sin), q, dy)[0]
    torch.testing.assert_close(R.rope_ref(dy, cos, sin, inverse=True), want, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_named():
    cos, sin = rope_tables(32, 8, 10000.0)
    with pytest.raises(ValueError, match="do not cover"):
        R.rope_rotate(torch.randn(1, 16, 2, 32), cos, sin)


@pytest.mark.gpu
def test_gpu_block_shape_matches_reference():
    """q of Llama-2-7B at 2048 tokens as a slice of [q|k|v]: 32 heads x 128 in one program per token."""
    qkv = torch.randn(1, 2048, 3 * 4096, device=DEV, dtype=torch.bfloat16)
    q = qkv[..., :4096].view(1, 2048, 32, 128)
    cos, sin = (t.to(DEV) for t in rope_tables(128, 2048, 10000.0))
    torch.testing.assert_close(R.rope_triton(q, cos, sin), R.rope_ref(q, cos, sin),
                               rtol=1e-2, atol=1e-2)  # both round fp32 to bf16; fp32 FMA contraction may differ
