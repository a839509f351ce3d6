"""Triton stage 1 of group scaling (fused elementwise + per-group amax) against the torch reference.

The amax must be exactly that of the output as stored (that is what makes a per-tensor scale safe); the
elementwise result itself may differ from torch's by rounding (silu's exp is not torch's), within a bf16 step.
"""
import pytest
import torch

from tests.ops.kernel_cases import DEVICE, SHAPES, same, wide
from megacoat.fp8 import elementwise_group_amax, group_amax, reduce_group_amax
from megacoat.ops.group_amax import elementwise_group_amax as kernel, group_amax as group_amax_kernel


@pytest.mark.parametrize("op", ["identity", "relu", "silu", "square"])
@pytest.mark.parametrize("shape,group_size", SHAPES[:5])
def test_fused_amax_is_amax_of_output(op, shape, group_size):
    x = wide(shape) * 0.01
    y, ga = elementwise_group_amax(x, op, group_size, torch.bfloat16, backend="triton")
    y_ref, _ = elementwise_group_amax(x, op, group_size, torch.bfloat16, backend="torch")
    assert same(ga, group_amax(y, group_size))
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=1e-30)
    y_plain, none = kernel(x, op, group_size, torch.bfloat16, with_amax=False)
    assert none is None and same(y_plain, y)


@pytest.mark.parametrize("shape,group_size", [((3, 300), 128), ((5000,), 128), ((2, 3, 130), 64), ((1,), 16)])
def test_per_tile_amax_reduces_to_the_same_tensor_amax(shape, group_size):
    x = wide(shape) * 0.01
    y, ga = kernel(x, "silu", group_size, torch.bfloat16, block=256)
    y_t, ta = kernel(x, "silu", group_size, torch.bfloat16, block=256, per_tile=True)
    assert same(y_t, y) and ta.dim() == 1 and ta.numel() < max(2, ga.numel())
    assert same(reduce_group_amax(ta), y.abs().amax().float()) and same(reduce_group_amax(ta), reduce_group_amax(ga))


def test_nonfinite_output_gives_infinite_amax():
    x = wide((4, 256))
    x[1, 7], x[3, 200] = float("nan"), float("-inf")
    for op in ("identity", "square"):
        y, ga = kernel(x, op, 128, torch.float32)
        _, ta = kernel(x, op, 128, torch.float32, per_tile=True, block=256)
        assert same(ga, group_amax(y, 128)) and ga[1, 0] == ga[3, 1] == float("inf")
        assert reduce_group_amax(ta) == float("inf") and (ta == float("inf")).sum() == 2


def test_stage1_alone_and_nan():
    x = wide((3, 300))
    x[1, 5] = float("nan")
    ga = group_amax_kernel(x, 128)
    assert same(ga, group_amax(x, 128)) and ga[1, 0] == float("inf")


@pytest.mark.gpu
def test_gpu_large():
    x = torch.randn(8192, 4096, device=DEVICE, dtype=torch.bfloat16)
    y, ga = kernel(x, "silu", 128, torch.bfloat16)
    assert same(ga, group_amax(y, 128))
    _, ta = kernel(x, "silu", 128, torch.bfloat16, per_tile=True)
    assert same(reduce_group_amax(ta), y.abs().amax().float())
    test_nonfinite_output_gives_infinite_amax()
    torch.testing.assert_close(y.float(), torch.nn.functional.silu(x.float()).bfloat16().float(), rtol=2 ** -7,
                               atol=1e-30)
