"""Group scaling (reference): the two-stage amax equals the tensor's, and the per-tensor result is unchanged."""
import pytest
import torch

from megacoat.fp8 import (elementwise_group_amax, group_amax, quantize_group_scaled, quantize_per_tensor,
                          reduce_group_amax)


def test_two_stage_amax_matches_global():
    x = torch.randn(6, 300)
    ga = group_amax(x, 128)
    assert ga.shape == (6, 3)
    assert reduce_group_amax(ga) == x.abs().max()
    a, b = quantize_group_scaled(x, "e4m3", ga), quantize_per_tensor(x, "e4m3")
    assert torch.equal(a.scale, b.scale) and torch.equal(a.data.float(), b.data.float())


@pytest.mark.parametrize("op", ["identity", "relu", "silu", "square"])
def test_elementwise_amax_is_of_stored_output(op):
    x = torch.randn(4, 256)
    y, ga = elementwise_group_amax(x, op, 64, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and ga.dtype == torch.float32
    assert torch.equal(ga, group_amax(y, 64))
    ref = {"identity": x, "relu": x.relu(), "silu": torch.nn.functional.silu(x), "square": x * x}[op]
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=0)


def test_nonfinite_and_errors():
    x = torch.randn(2, 128)
    x[1, 3] = float("nan")
    assert reduce_group_amax(group_amax(x, 128)) == float("inf")
    assert torch.isnan(quantize_group_scaled(x).dequantize()).all()
    with pytest.raises(ValueError, match="op must be"):
        elementwise_group_amax(x, "tanh")
    with pytest.raises(TypeError, match="float32"):
        reduce_group_amax(torch.ones(3, dtype=torch.bfloat16))
