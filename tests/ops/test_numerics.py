"""megacoat.ops.numerics' CPU decoding: the table gather is q.float(), bit for bit, and group_dequantize keeps its
values with it."""
import pytest
import torch
import torch.nn.functional as F

from megacoat.ops.numerics import FP8_DTYPES, fp8_to_float32, group_dequantize, group_quantize


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_to_float32_is_the_exact_conversion_of_every_code(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    q = codes.reshape(16, 16).t()  # non-contiguous too
    out = fp8_to_float32(q)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.equal(out.view(torch.int32), q.float().view(torch.int32))  # NaN codes and -0 included


def test_fp8_to_float32_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = fp8_to_float32(torch.empty(4, 8, dtype=torch.float8_e4m3fn))
    assert out.shape == (4, 8) and out.dtype == torch.float32


@pytest.mark.parametrize("d", [256, 200])  # whole groups (no padding) and a short last group
def test_group_dequantize_matches_the_padded_float_formula(d):
    x = torch.randn(8, d) * 5
    q, scale = group_quantize(x, 64, torch.float8_e4m3fn)
    ref = (F.pad(q.float(), (0, scale.shape[1] * 64 - d)).view(8, -1, 64) * scale[..., None]).view(8, -1)[:, :d]
    assert torch.equal(group_dequantize(q, scale, 64), ref)
