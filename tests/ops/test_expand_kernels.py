"""Triton expansion quantize/dequantize against the torch references (megacoat.fp8.expansion).

GPU (marker gpu): bit-exact -- same float32 operations in the same order, libdevice log2/exp2 like torch's CUDA
log2f/exp2f. CPU interpreter: k and scale must match exactly; q may differ by one FP8 step in a few elements,
because there the kernel's log2/exp2 are numpy's float32 ones while the reference uses torch's CPU (SLEEF)
versions, which can differ by one float32 ulp and so flip the FP8 rounding of a value sitting on a rounding
boundary (we allow at most 1 in 1000 elements, each by at most one step).
"""
import pytest
import torch

from tests.ops.kernel_cases import DEVICE, INTERPRETED, SHAPES, same, same_output, wide, with_edge_groups
import triton
import triton.language as tl

from megacoat.fp8 import expand_dequantize, expand_quantize
from megacoat.ops import expand_math


def _within_one_step(a, b, fmt_dtype):
    a, b = a.float(), b.float()
    fi = torch.finfo(fmt_dtype)
    step = torch.maximum(b.abs() * fi.eps, torch.full_like(b, fi.smallest_normal * fi.eps))
    diff = a != b
    return bool(((a - b).abs()[diff] <= step[diff] * 1.0001).all()) and diff.float().mean() <= 1e-3


def _quantize(x, fmt, group_size, variant):
    from megacoat.fp8.expansion import K_MAX, K_MIN, log2_range
    from megacoat.fp8.formats import get_format
    from megacoat.ops.expand_quantize import expand_quantize as kernel

    f = get_format(fmt)
    return kernel(x, f.dtype, group_size, log2_range(f), K_MIN, K_MAX, lean=variant == "default")


def _dequantize(qt, dtype, variant):
    from megacoat.ops.expand_dequantize import expand_dequantize as kernel

    return kernel(qt.data, qt.scale, qt.k, qt.group_size, dtype, vec=None if variant == "default" else 0)


def _check(x, fmt, group_size, variant="default"):
    """variant "default": the library's kernels; "session2": lean=False / vec=0, kept for the benchmark."""
    ref = expand_quantize(x, fmt, group_size, backend="torch")
    q, scale, k = _quantize(x, fmt, group_size, variant)
    assert same(k, ref.k) and same(scale, ref.scale)
    if INTERPRETED:
        assert _within_one_step(q, ref.data, ref.data.dtype)
    else:
        assert same(q, ref.data)
    for dtype in (torch.float32, torch.bfloat16):
        a = _dequantize(ref, dtype, variant)
        b = expand_dequantize(ref, dtype, backend="torch")
        if INTERPRETED and dtype == torch.float32:  # numpy vs SLEEF log2/exp2: a few float32 ulps
            torch.testing.assert_close(a, b, rtol=8 * 2 ** -24, atol=0, equal_nan=True)
        elif INTERPRETED:
            assert same_output(a, b) or torch.allclose(a.float(), b.float(), rtol=2 ** -7, equal_nan=True)
        else:
            assert same(a, b)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,group_size", SHAPES)
def test_expand_matches_reference(fmt, shape, group_size):
    _check(wide(shape), fmt, group_size)


def test_expand_nonnegative_and_narrow():
    x = wide((4, 512)).square()  # second-moment-like
    _check(x, "e4m3", 128)
    _check(x, "e5m2", 128)
    _check(1 + torch.rand(3, 256, device=DEVICE), "e4m3", 128)  # k > 1, clamped at K_MAX in places


def test_expand_edge_groups():
    x = with_edge_groups(wide((5 * 128,)), 128)
    x[3 * 128:4 * 128] = -0.5  # one distinct magnitude
    _check(x, "e4m3", 128)
    qt = expand_quantize(x, "e4m3", 128, backend="triton")
    assert qt.nonfinite_groups().item() == 2 and qt.k.float().tolist()[:4] == [1.0, 1.0, 1.0, 1.0]
    xh = qt.dequantize()
    assert (xh[:128] == 0).all() and torch.isnan(xh[128:384]).all() and torch.equal(xh[384:512], x[384:512])


def test_session2_kernels_match_reference():
    x = with_edge_groups(wide((3, 1000)), 128)
    for fmt in ("e4m3", "e5m2"):
        _check(x, fmt, 128, "session2")
        _check(x.square(), fmt, 64, "session2")
    _check(wide((2, 3, 130), torch.bfloat16), "e4m3", 32, "session2")


def test_bf16_input_and_group_sizes():
    for g in (16, 32, 64, 128, 256):
        _check(wide((3, 2 * g + 5), torch.bfloat16), "e4m3", g)


def huge_range_groups(n_groups, device=DEVICE, seed=0):
    """Non-negative groups spanning 2^-100 .. 2^30 (k near K_MIN): |x| / amax and (|q| / F.max)^(1/k) both fall
    below float32's smallest normal, where the reference and the kernels flush to 0 (GPU libdevice runs FTZ)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    e = torch.empty(n_groups, 128).uniform_(-100, 30, generator=g)
    e[:, 0], e[:, 1] = -100, 30
    return torch.exp2(e).to(device)


def test_tiny_amax_groups():
    """amax a float32 subnormal: 1 / amax would overflow; the reference and the kernels scale by 2^-126."""
    from tests.ops.test_quantize_kernels import tiny_groups

    x = tiny_groups()
    for fmt in ("e4m3", "e5m2"):
        _check(x, fmt, 128)
        _check(x, fmt, 128, "session2")
        xh = expand_quantize(x, fmt, 128, backend="torch").dequantize()
        assert torch.isfinite(xh).all() and (xh[256:384] == 0).sum() >= 127


def test_float32_subnormal_flush():
    x = huge_range_groups(64)
    ref = expand_quantize(x, "e4m3", 128, backend="torch")
    assert (ref.k.float() < 0.2).all()
    xh = expand_dequantize(ref, torch.float32, backend="torch")
    flushed = (xh == 0) & (ref.data.float() != 0)
    assert flushed.any()  # the case exists in this data: the dequantized value would be a float32 subnormal
    _check(x, "e4m3", 128)
    _check(x, "e5m2", 128)
    _check(x, "e4m3", 128, "session2")


@triton.jit
def _log2_normal_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, expand_math.log2_normal(tl.load(x_ptr + offs, mask=mask, other=1.0)), mask=mask)


def test_log2_normal_is_libdevice_log2f_on_normals():
    """expand_math.log2_normal is libdevice's log2f sequence without its special-case paths. Interpreter: within
    1 float32 ulp of the exact log2 (numpy stands in for the FMAs); GPU: bit-exact with torch.log2 (CUDA's
    log2f) over normal floats from 2^-126 up, which is what the kernels' bit-exactness rests on."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 1 << (20 if not INTERPRETED else 14)
    x = torch.exp2(torch.empty(n).uniform_(-126, 0, generator=g))
    x = torch.cat([x, torch.tensor([2.0 ** -126, 1.0, 0.5, 0.70710677, 0.7071068, 1.4142135, 3.0, 2.0 ** 100])])
    x = x.to(DEVICE)
    y = torch.empty_like(x)
    _log2_normal_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    if INTERPRETED:
        exact = torch.log2(x.double())
        ulp = (torch.nextafter(y, torch.full_like(y, float("inf"))) - y).double()
        err = (y.double() - exact).abs()
        assert (err <= ulp).all(), f"worst {(err / ulp).max():.2f} ulp"
    else:
        assert same(y, torch.log2(x))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("variant", ["default", "session2"])
def test_gpu_bit_exact_large(fmt, variant):
    for shape, g in [(((1 << 22) + 77,), 128), ((4096, 1000), 128), ((2048, 4096), 32)]:
        _check(wide(shape, seed=3), fmt, g, variant)
    _check(wide((1 << 22,), seed=4).square(), fmt, 128, variant)  # non-negative: session 2's one GPU failure
    _check(wide((1 << 22,), torch.bfloat16, seed=5), fmt, 128, variant)
    _check(with_edge_groups(wide((1 << 20,)), 128), fmt, 128, variant)
    _check(huge_range_groups(1 << 14), fmt, 128, variant)


@pytest.mark.gpu
def test_gpu_small_cases_bit_exact():
    """The CPU cases above, on the GPU under `pytest -m gpu` (there they must be bit-exact)."""
    test_log2_normal_is_libdevice_log2f_on_normals()
    test_expand_nonnegative_and_narrow()
    test_expand_edge_groups()
    test_session2_kernels_match_reference()
    test_bf16_input_and_group_sizes()
    test_float32_subnormal_flush()
    test_tiny_amax_groups()
    for shape, g in SHAPES:
        for fmt in ("e4m3", "e5m2"):
            _check(wide(shape), fmt, g)


def _check_approx(x, fmt):
    """approx_math (PTX lg2/ex2.approx): q within one FP8 step of the reference's; dequantized values within
    the error those instructions allow. lg2.approx: 2 ulp of its result, |log2(rq)| * 2^-22; divided by k and
    turned into a relative error by exp2 (x ln 2); ex2.approx: 2 ulp. Bound used: (|log2 rq| + 1) * 2^-21 / k * ln 2
    + 2^-20 (a factor 2 of margin on each term)."""
    import math

    from megacoat.fp8.expansion import K_MAX, K_MIN, log2_range
    from megacoat.fp8.formats import get_format
    from megacoat.ops.expand_dequantize import expand_dequantize as deq_kernel
    from megacoat.ops.expand_quantize import expand_quantize as q_kernel

    f = get_format(fmt)
    ref = expand_quantize(x, fmt, 128, backend="torch")
    q, s, k = q_kernel(x, f.dtype, 128, log2_range(f), K_MIN, K_MAX, approx_math=True)
    assert same(s, ref.scale) and same(k, ref.k)
    assert _within_one_step(q, ref.data, f.dtype) or INTERPRETED is False and bool(
        ((q.float() - ref.data.float()).abs() <= torch.maximum(ref.data.float().abs() * f.eps,
                                                               torch.full_like(ref.data.float(), f.min_subnormal))
         * 1.0001).all())
    xr = ref.dequantize(torch.float32, backend="torch")
    xa = deq_kernel(ref.data, ref.scale, ref.k, 128, torch.float32, approx_math=True)
    rq = ref.data.float().abs() / f.max
    kf = ref.k.float().repeat_interleave(128)[: x.numel()].reshape(x.shape)
    bound = (rq.clamp_min(1e-30).log2().abs() + 1) * 2 ** -21 / kf * math.log(2) + 2 ** -20
    m = (ref.scale * f.max).repeat_interleave(128)[: x.numel()].reshape(x.shape)
    live = xr.abs() >= 2.0 ** -124 * m  # away from the float32 flush at e = 2^-126, where either side may flush
    assert ((xa - xr).abs()[live] <= bound[live] * xr.abs()[live]).all()


def test_approx_math_interpreted_or_gpu():
    _check_approx(wide((4096,)), "e4m3")
    _check_approx(wide((4096,)).square(), "e5m2")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_approx_math_tolerance(fmt):
    _check_approx(wide((1 << 22,), seed=5), fmt)
    _check_approx(wide((1 << 22,), seed=6).square(), fmt)


@pytest.mark.slow
def test_every_variant_compiles_for_sm90(tmp_path):
    """The interpreter runs kernels as Python, so code that Triton cannot compile (an early return in a constexpr
    branch, say) passes the CPU tests; compile every variant for Hopper without a GPU, in a fresh process (this
    one runs the interpreter). Static SASS of each: python benchmarks/bench_quant.py --sass."""
    import os
    import subprocess
    import sys

    code = """
import sys
from benchmarks.kernel_sass import compile_sm90
from megacoat.ops import dequantize as pdq, expand_dequantize as dq, expand_quantize as eq, group_amax as ga
from megacoat.ops import quantize_per_group as pq, quantize_per_tensor as pt
ints = dict(cols="i32:16", n_groups="i32:16", blocks_per_row="i32:16")
for t in ("fp32", "bf16"):
    for lean, approx in ((True, False), (False, False), (True, True), (False, True)):
        compile_sm90(eq._expand_quantize_kernel, dict(x_ptr=f"*{t}:16", q_ptr="*fp8e5:16", scale_ptr="*fp32:16",
                     k_ptr="*bf16:16", log2_range="fp32", k_min="fp32", k_max="fp32", **ints),
                     dict(FP8_MAX=57344.0, APPROX=approx, LEAN=lean, G=64, BLOCK_G=32), 4)
    for vec, lanes, lut, approx in ((8 // (2 if t == "fp32" else 1), 4, True, False), (0, 1, True, False),
                                    (4, 2, False, False), (4, 4, False, True)):
        compile_sm90(dq._expand_dequantize_kernel, dict(q_ptr="*fp8e4nv:16", scale_ptr="*fp32:16",
                     k_ptr="*bf16:16", lut_ptr="*fp32:16", out_ptr=f"*{t}:16", **ints),
                     dict(FP8_MAX=448.0, INV_FP8_MAX=1 / 448, LUT=lut, APPROX=approx, VEC=vec, LANES=lanes, G=128,
                          BLOCK_G=16), 4)
    compile_sm90(pq._quantize_per_group_kernel, dict(x_ptr=f"*{t}:16", q_ptr="*fp8e4nv:16", scale_ptr="*fp32:16",
                 **ints), dict(FP8_MAX=448.0, AMAX_FLOOR=2.0 ** -119, G=128, BLOCK_G=16), 4)
    compile_sm90(pt._quantize_per_tensor_kernel, dict(x_ptr=f"*{t}:16", q_ptr="*fp8e5:16", amax_ptr="*fp32:16",
                 n="i32"), dict(FP8_MAX=57344.0, AMAX_FLOOR=2.0 ** -112, BLOCK=2048), 4)
    for vec, lanes in ((8 // (2 if t == "fp32" else 1), 4), (0, 1), (4, 2)):
        compile_sm90(pdq._dequantize_per_group_kernel, dict(q_ptr="*fp8e4nv:16", scale_ptr="*fp32:16",
                     out_ptr=f"*{t}:16", **ints), dict(VEC=vec, LANES=lanes, G=128, BLOCK_G=16), 4)
for amax, per_tile, write_y in ((True, False, True), (True, True, True), (False, False, True), (True, False, False)):
    compile_sm90(ga._elementwise_group_amax_kernel, dict(x_ptr="*bf16:16", y_ptr="*bf16:16", amax_ptr="*fp32:16",
                 **ints), dict(OP=2, WITH_AMAX=amax, PER_TILE=per_tile, WRITE_Y=write_y, G=128, BLOCK_G=16), 4)

# log2_normal must be libdevice's log2f: every float constant it uses appears in libdevice.log2's PTX
import re
import triton
import triton.language as tl
from megacoat.ops import expand_math as em

@triton.jit
def k_lib(x_ptr, y_ptr):
    o = tl.arange(0, 128)
    tl.store(y_ptr + o, em.log2(tl.load(x_ptr + o)))

@triton.jit
def k_mine(x_ptr, y_ptr):
    o = tl.arange(0, 128)
    tl.store(y_ptr + o, em.log2_normal(tl.load(x_ptr + o)))

def consts(fn):
    ptx = compile_sm90(fn, dict(x_ptr="*fp32:16", y_ptr="*fp32:16"), {}, 4).asm["ptx"]
    return set(re.findall(r"0f[0-9A-F]{8}", ptx[ptx.index("ld.global"):ptx.index("st.global")]))

lib, mine = consts(k_lib), consts(k_mine)
assert len(mine) >= 12 and mine <= lib, (sorted(mine - lib), sorted(lib))
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the device's Triton 3.6 fuses by default
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "compile_variants.py"  # @triton.jit needs its source in a file
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
