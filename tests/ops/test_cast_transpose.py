"""FP8 cast + transpose: Triton against the torch reference."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, assert_fp8_close, interpreted  # noqa: I001
from megacoat.ops import cast_transpose as C


@pytest.mark.parametrize("shape", [(48, 80), (130, 33)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_matches_reference(shape, dtype):
    if DEV == "cpu" and not interpreted(C._cast_transpose_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    x = (torch.randn(*shape, device=DEV) * 5).to(torch.bfloat16)
    scale = C.amax_scale(x, dtype)
    q, qt = C.cast_transpose_triton(x, scale, dtype)
    rq, rqt = C.cast_transpose_ref(x, scale, dtype)
    assert_fp8_close(q, rq)
    assert torch.equal(qt, q.t().contiguous())
    only_t = C.cast_transpose_triton(x, scale, dtype, rowwise=False)
    assert only_t[0] is None and torch.equal(only_t[1], qt)


def test_zero_tensor_has_finite_scale():
    x = torch.zeros(16, 16)
    scale = C.amax_scale(x, torch.float8_e4m3fn)
    q, _ = C.cast_transpose_ref(x, scale, torch.float8_e4m3fn)
    assert scale.item() > 0 and (q.float() == 0).all()
