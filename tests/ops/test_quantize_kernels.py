"""Triton per-tensor / per-group quantize and dequantize against the torch references.

On CPU (interpreter) the kernels must match bit for bit too: the interpreter's broken FP8 cast is bypassed by
megacoat.ops.quantize_cast, and the float32 operations are the reference's. On the GPU (marker gpu) the test
covers large tensors and the native conversion.
"""
import pytest
import torch

# kernel_cases first: it sets TRITON_INTERPRET before megacoat.ops is imported
from tests.ops.kernel_cases import DEVICE, INTERPRETED, SHAPES, same, same_output, wide, with_edge_groups
from megacoat.fp8 import dequantize, quantize_group_scaled, quantize_per_group, quantize_per_tensor
from megacoat.ops.dequantize import dequantize as deq_kernel
from megacoat.ops.group_amax import group_amax as group_amax_kernel


def _check_group(x, fmt, group_size, out_dtypes=(torch.float32, torch.bfloat16)):
    ref = quantize_per_group(x, fmt, group_size, backend="torch")
    tri = quantize_per_group(x, fmt, group_size, backend="triton")
    assert same(tri.data, ref.data) and same(tri.scale, ref.scale)
    for dtype in out_dtypes:
        b = dequantize(ref, dtype, backend="torch")
        assert same_output(dequantize(ref, dtype, backend="triton"), b)
        assert same_output(deq_kernel(ref.data, ref.scale, group_size, dtype, vec=0), b)  # the session-2 tile


def _check_tensor(x, fmt):
    ref = quantize_per_tensor(x, fmt, backend="torch")
    tri = quantize_per_tensor(x, fmt, backend="triton")
    assert same(tri.data, ref.data) and same(tri.scale, ref.scale)
    assert same(dequantize(ref, backend="triton"), dequantize(ref, backend="torch"))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,group_size", SHAPES)
def test_per_group_matches_reference(fmt, shape, group_size):
    _check_group(wide(shape), fmt, group_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_group_low_precision_input(dtype):
    _check_group(wide((3, 384), dtype), "e4m3", 128)


def tiny_groups(device=DEVICE):
    """Groups whose amax is below F.max / FLT_MAX (normal and subnormal float32): the amax floor applies."""
    x = wide((6 * 128,), device="cpu").abs() * 1e-40
    x[:128] *= 1e3  # ~1e-37 .. 1e-39: normal amax under the floor
    x[256:384] = 0.0
    x[300] = 1e-45  # one subnormal in a zero group
    return x.to(device)


def test_tiny_amax_groups():
    # bf16 output here is subnormal, which the interpreter's float32 -> bf16 cast gets wrong (GPU: exact)
    out_dtypes = (torch.float32,) if INTERPRETED else (torch.float32, torch.bfloat16)
    for fmt in ("e4m3", "e5m2"):
        _check_group(tiny_groups(), fmt, 128, out_dtypes)
        _check_tensor(tiny_groups(), fmt)


def test_per_group_edge_groups():
    x = with_edge_groups(wide((5 * 128,)), 128)
    _check_group(x, "e4m3", 128)
    assert quantize_per_group(x, backend="triton").nonfinite_groups().item() == 2


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(4, 256), (3, 301), (1,)])
def test_per_tensor_matches_reference(fmt, shape):
    _check_tensor(wide(shape) * 1e-3, fmt)


def test_per_tensor_edge_cases():
    _check_tensor(torch.zeros(300, device=DEVICE), "e4m3")
    _check_tensor(with_edge_groups(wide((600,)), 128), "e4m3")
    x = wide((3, 300))
    ga = group_amax_kernel(x, 128)
    assert ga.shape == (3, 3) and ga.max() == x.abs().max()
    a = quantize_group_scaled(x, "e4m3", ga, backend="triton")
    b = quantize_per_tensor(x, "e4m3", backend="torch")
    assert same(a.data, b.data) and same(a.scale, b.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_bit_exact_large(fmt):
    for shape, g in [(((1 << 22) + 77,), 128), ((4096, 1000), 128), ((8192, 4096), 64)]:
        x = wide(shape, seed=1)
        _check_group(x, fmt, g)
        _check_group(x.bfloat16(), fmt, g)
    _check_tensor(wide(((1 << 22) + 5,), seed=2), fmt)
    _check_group(with_edge_groups(wide((1 << 20,)), 128), fmt, 128)
    test_tiny_amax_groups()
