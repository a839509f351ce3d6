"""megacoat.ops.fp8_gemm.scaled_mm against torch._scaled_mm on small shapes, every operand format, both scale
granularities and both layouts of b that the FP8 linears pass.

Tolerance: both sides form sum_k (a_k * sa) * (b_k * sb) in float32 from the same exactly decoded FP8 values, so
they differ at most by the order of the float32 accumulation (a BLAS may block K differently from torch's CPU
emulation, or from a oneDNN kernel that applies the scales after the sum): each is within gamma_K * sum|a_k b_k|
of the exact sum (Higham's dot-product bound, gamma_K ~ K * 2^-24), and the scale products add 2 * 2^-24
relative each, so |ours - ref| <= 2 * (K + 2) * 2^-24 * (|a| @ |b|) before the output cast, which adds at most one
rounding of out_dtype at the reference's magnitude. On this build the two agree bitwise, also checked where the
reference is known to be the upcast (test_bitwise_equal_to_the_upcast_reference).
"""
import pytest
import torch

from megacoat.ops.fp8_gemm import decode, gemm_op, scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _operands(m, k, n, dtype_a, dtype_b, rowwise, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) / 7  # the weight, row-major [N, K]; b = w.t() is column-major
    if rowwise:
        sa = a.abs().amax(1, keepdim=True) / torch.finfo(dtype_a).max
        sw = w.abs().amax(1, keepdim=True) / torch.finfo(dtype_b).max
    else:
        sa = (a.abs().amax() / torch.finfo(dtype_a).max).reshape(1)
        sw = (w.abs().amax() / torch.finfo(dtype_b).max).reshape(1)
    a8, w8 = (a / sa).to(dtype_a), (w / sw).to(dtype_b)
    return a8, w8, sa.float(), (sw.t() if rowwise else sw).float()


def _bound(a8, b8, sa, sb, ref, out_dtype):
    absprod = decode(a8, sa).abs() @ decode(b8, sb).abs()
    k = a8.shape[1]
    out_ulp = torch.finfo(out_dtype).eps * ref.float().abs()
    return 2 * (k + 2) * 2.0 ** -24 * absprod + out_ulp


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)],
                         ids=["e4m3", "e5m2-a", "e5m2-b", "e5m2"])
@pytest.mark.parametrize("col_major_b", [True, False])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_matches_torch_scaled_mm(rowwise, out_dtype, dtypes, col_major_b, fast_accum):
    m, k, n = 32, 48, 64
    a8, w8, sa, sb = _operands(m, k, n, *dtypes, rowwise)
    b8 = w8.t() if col_major_b else w8.t().contiguous()
    ref = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    out = scaled_mm(a8, b8, sa, sb, out_dtype, fast_accum)
    assert out.dtype == out_dtype and out.shape == (m, n)
    diff = (out.float() - ref.float()).abs()
    assert (diff <= _bound(a8, b8, sa, sb, ref, out_dtype)).all(), diff.max()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_bitwise_equal_to_the_upcast_reference(rowwise):
    """The plain upcast (elementwise float32 decode times the scale, then matmul) is the definition; the table
    decode must reproduce it bit for bit, NaN and signed-zero codes included."""
    a8, w8, sa, sb = _operands(48, 64, 32, E4M3, E5M2, rowwise)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    a8 = a8.clone()
    a8.view(torch.uint8)[0, :] = codes[64:128]  # includes E4M3's NaN code 0x7f and -0 (0x80 is in row 1)
    a8.view(torch.uint8)[1, :] = codes[128:192]
    ref = ((a8.float() * sa) @ (w8.t().float() * sb)).to(torch.bfloat16)
    out = scaled_mm(a8, w8.t(), sa, sb, torch.bfloat16)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])
    for x8, s in ((a8, sa), (w8.t(), sb)):
        assert torch.equal(decode(x8, s).view(torch.int32), (x8.float() * s).view(torch.int32))


def test_cpu_runs_the_registered_operator_and_compiles():
    """On the CPU scaled_mm is megacoat::scaled_mm (so a trace shows each FP8 GEMM and its fast-accum flag);
    its fake gives torch.compile the output's shape and dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    a8, w8, sa, sb = _operands(16, 32, 48, E4M3, E4M3, rowwise=False)
    b8 = w8.t()
    with Seen() as seen:
        out = scaled_mm(a8, b8, sa, sb, torch.float32)
    assert seen.ops == [gemm_op("cpu")] and gemm_op("cuda") is torch.ops.aten._scaled_mm.default
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: scaled_mm(*t, torch.float32), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a8, b8, sa, sb), out)


def test_refuses_non_fp8_operands_and_block_scales():
    a8, w8, sa, sb = _operands(16, 32, 48, E4M3, E4M3, rowwise=False)
    with pytest.raises(ValueError, match="FP8"):
        scaled_mm(a8.float(), w8.t(), sa, sb, torch.float32)
    with pytest.raises(ValueError, match="row-wise"):
        scaled_mm(a8, w8.t(), torch.ones(16, 2), sb, torch.float32)
