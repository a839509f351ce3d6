"""FP8 cast + transpose: Triton against the torch reference, the scale from amax, and the edge cases."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, assert_fp8_close, interpreted  # noqa: I001
from megacoat.ops import cast_transpose as C
from megacoat.ops.numerics import AMAX_FLOOR

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _kernels_usable():
    if DEV == "cpu" and not interpreted(C._cast_transpose_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")


@pytest.mark.parametrize("shape", [(48, 80), (130, 33)])
@pytest.mark.parametrize("dtype", [E4, E5])
def test_triton_matches_reference(shape, dtype):
    _kernels_usable()
    x = (torch.randn(*shape, device=DEV) * 5).to(torch.bfloat16)
    scale = C.amax_scale(x, dtype)
    q, qt = C.cast_transpose_triton(x, scale, dtype)
    rq, rqt = C.cast_transpose_ref(x, scale, dtype)
    assert_fp8_close(q, rq)
    assert torch.equal(qt, q.t().contiguous())
    only_t = C.cast_transpose_triton(x, scale, dtype, rowwise=False)
    assert only_t[0] is None and torch.equal(only_t[1], qt)


@pytest.mark.parametrize("dtype", [E4, E5])
def test_quantize_transpose_writes_the_scale_from_amax(dtype):
    _kernels_usable()
    x = (torch.randn(130, 33, device=DEV) * 3).to(torch.bfloat16)
    q, qt, scale = C.quantize_transpose_triton(x, dtype)
    rq, rqt, rscale = C.quantize_transpose_ref(x, dtype)
    # the scale is float32 arithmetic on an exact amax: identical, even under the interpreter
    assert scale.dtype == torch.float32 and scale.shape == (1,) and torch.equal(scale, rscale)
    amax = x.float().abs().max().cpu()
    assert torch.equal(scale.cpu(), (amax / torch.tensor(torch.finfo(dtype).max)).reshape(1))
    assert_fp8_close(q, rq)
    assert torch.equal(qt, q.t().contiguous())
    # the largest |x| lands on the format's max: the full range is used
    assert q.float().abs().max().item() == torch.finfo(dtype).max
    q_only, none, _ = C.quantize_transpose_triton(x, dtype, transpose=False)
    assert none is None and torch.equal(q_only, q)


@pytest.mark.parametrize("fn", ["ref", "triton"])
def test_zero_and_subnormal_tensors_scale_from_the_amax_floor(fn):
    """amax below AMAX_FLOOR = 2^-126 is raised to it (megacoat.ops.numerics): scale = 2^-126 / fmax, whose
    reciprocal overflows float32, so the cast divides instead -- zeros stay zeros, tiny values keep their codes."""
    if fn == "triton":
        _kernels_usable()
    floor_scale = (torch.tensor(AMAX_FLOOR) / torch.tensor(torch.finfo(E4).max)).reshape(1)
    q, qt, scale = getattr(C, f"quantize_transpose_{fn}")(torch.zeros(16, 16, device=DEV), E4)
    assert torch.equal(scale.cpu(), floor_scale) and (q.float() == 0).all() and (qt.float() == 0).all()
    x = torch.zeros(16, 16, device=DEV)
    x[2, 3], x[5, 1] = 2.0 ** -130, -(2.0 ** -128)  # float32 sub-normals
    q, qt, scale = getattr(C, f"quantize_transpose_{fn}")(x, E4)
    assert torch.equal(scale.cpu(), floor_scale)
    want = (x.double() / floor_scale.double().to(DEV)).to(E4)  # exact quotient, rounded once
    assert torch.equal(q.float(), want.float()) and q[2, 3].float() > 0 and q[5, 1].float() < 0


def test_nonfinite_input_gives_a_nan_scale_not_a_silent_result():
    x = torch.randn(32, 32, device=DEV)
    x[3, 5] = float("nan")
    assert torch.isnan(C.tensor_amax(x)).all()  # NaN propagates through the one-kernel amax
    assert torch.isnan(C.quantize_transpose(x, E4)[2]).all()
    x[3, 5] = float("inf")
    assert torch.isinf(C.quantize_transpose(x, E4)[2]).all()


@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("transpose", [True, False])
def test_delayed_meets_current_where_the_amax_repeats(backend, transpose):
    """Delayed scaling: the first call (bootstrap) is quantize_transpose and records its amax; a call whose history
    holds its own amax writes quantize_transpose's bytes (the layouts asked for, the scale) in one launch; a larger
    tensor saturates at the recorded scale, and the history rolls with each call's amax in front."""
    if backend == "triton":
        _kernels_usable()
    delayed = getattr(C, f"cast_transpose_delayed_{backend}")
    x = (torch.randn(130, 48, device=DEV) * 3).to(torch.bfloat16)
    cur = C.quantize_transpose_ref(x, E5, transpose=transpose)
    history = torch.zeros(4, device=DEV)
    first = delayed(x, history, E5, transpose=transpose, bootstrap=True)
    amax = x.float().abs().max().item()
    assert history.tolist() == [amax, 0.0, 0.0, 0.0]
    again = delayed(x, history, E5, transpose=transpose)
    for got in (first, again):
        assert torch.equal(got[2], cur[2])
        assert_fp8_close(got[0], cur[0])
        assert (got[1] is None) == (not transpose) and (not transpose or torch.equal(got[1], got[0].t().contiguous()))
    assert history.tolist() == [amax, amax, 0.0, 0.0]
    big = delayed(4 * x, history, E5, transpose=transpose)
    assert torch.equal(big[2], cur[2])  # the recorded scale, not this call's
    assert big[0].float().abs().max().item() == torch.finfo(E5).max  # beyond it: saturated, never inf
    assert history.tolist() == [4 * amax, amax, amax, 0.0]


def test_delayed_triton_matches_the_reference_with_a_history():
    """A history from other calls (a scale unrelated to this call's amax): the kernel's codes are the reference's,
    and both roll the same amax in (an exact max, in any order)."""
    _kernels_usable()
    x = (torch.randn(70, 96, device=DEV) * 2).to(torch.bfloat16)
    hists = [torch.tensor([0.0, 3.0, 1.5], device=DEV) for _ in range(2)]
    t8, t8t, tscale = C.cast_transpose_delayed_triton(x, hists[0], E4)
    r8, r8t, rscale = C.cast_transpose_delayed_ref(x, hists[1], E4)
    assert torch.equal(tscale, rscale) and torch.equal(hists[0], hists[1])
    assert_fp8_close(t8, r8)
    assert torch.equal(t8t, t8.t().contiguous())
    assert hists[0][1:].tolist() == [0.0, 3.0]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="2-D"):
        C.quantize_transpose(torch.randn(2, 3, 4, device=DEV), E4)
    with pytest.raises(ValueError, match="empty"):
        C.quantize_transpose(torch.empty(0, 16, device=DEV), E4)


@pytest.mark.parametrize("shape", [(48, 80), (130, 33), (1, 7)])
@pytest.mark.parametrize("dtype", [E4, E5])
def test_transpose_fp8_moves_the_bytes_as_they_are(shape, dtype):
    """Every byte pattern (NaN and inf codes included) lands in its transposed place, unchanged; tiles cut short at
    both edges."""
    _kernels_usable()
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV)
    q = raw.view(dtype)
    qt = C.transpose_fp8_triton(q)
    assert qt.dtype == dtype and qt.shape == shape[::-1] and qt.is_contiguous()
    assert torch.equal(qt.view(torch.uint8), raw.t().contiguous())
    assert torch.equal(C.transpose_fp8_ref(q).view(torch.uint8), raw.t().contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [E4, E5])
def test_gpu_bit_exact_with_reference(dtype, x_dtype):
    """On the GPU the kernel does the reference's float32 operations: same bytes (both layouts), same scale, for
    bf16 and float32 inputs (a float32 tile's transposed store once came out wrong: NaN gradients in --fp32)."""
    x = (torch.randn(2048, 4096, device="cuda") * 7).to(x_dtype)
    q, qt, scale = C.quantize_transpose(x, dtype)
    rq, rqt, rscale = C.quantize_transpose_ref(x, dtype)
    assert torch.equal(scale, rscale)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8))
    # delayed scaling: with the history holding this tensor's amax, the one launch writes the same bytes
    history = torch.zeros(16, device="cuda")
    C.cast_transpose_delayed(x, history, dtype, bootstrap=True)
    dq, dqt, dscale = C.cast_transpose_delayed(x, history, dtype)
    assert torch.equal(dscale, scale) and torch.equal(history[:2], x.float().abs().amax().repeat(2))
    assert torch.equal(dq.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dqt.view(torch.uint8), qt.view(torch.uint8))


@pytest.mark.parametrize("fn", ["ref", "triton"])
@pytest.mark.parametrize("rows", [(48,), (32, 16, 48), (64, 80)])
@pytest.mark.parametrize("transpose", [True, False])
def test_quantize_transpose_into_equals_the_joined_quantization(fn, rows, transpose):
    """The refresh's path (parts written straight into existing copies) gives quantize_transpose's bytes and scale
    for the joined tensor, bit for bit, backend by backend: the amax is a max (exact in any order) and each
    element's cast is the same kernel's."""
    if fn == "triton":
        _kernels_usable()
    parts = [(torch.randn(r, 48, device=DEV) * (i + 1)).to(torch.bfloat16) for i, r in enumerate(rows)]
    want_q, want_qt, want_scale = getattr(C, f"quantize_transpose_{fn}")(torch.cat(parts), E4)
    n = sum(rows)
    q = torch.full((n, 48), float("nan"), device=DEV).to(E4)  # stale contents must all be overwritten
    qt = torch.full((48, n), float("nan"), device=DEV).to(E4) if transpose else None
    scale = torch.zeros(1, device=DEV)
    getattr(C, f"quantize_transpose_into_{fn}")(parts, q, qt, scale)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if transpose:
        assert torch.equal(qt.view(torch.uint8), want_qt.view(torch.uint8))


def test_quantize_transpose_into_propagates_a_nan_of_any_part():
    parts = [torch.randn(16, 32, device=DEV), torch.randn(32, 32, device=DEV)]
    assert torch.equal(C.joined_amax_ref(parts), C.tensor_amax(torch.cat(parts)))
    parts[1][3, 4] = float("nan")
    assert torch.isnan(C.joined_amax_ref(parts)).all()
    q, qt = torch.empty(48, 32, device=DEV).to(E4), torch.empty(32, 48, device=DEV).to(E4)
    scale = torch.zeros(1, device=DEV)
    C.quantize_transpose_into(parts, q, qt, scale)
    assert torch.isnan(scale).all()


@pytest.mark.parametrize("fn", ["ref", "triton"])
def test_joined_amax_is_the_exact_max_over_blocks_and_parts(fn):
    """The refresh's amax kernel: blocks of 8192 elements (the last one partial) and several parts fold into one
    exact max, whichever part and block hold it; a NaN anywhere, even beside larger numbers, wins."""
    if fn == "triton":
        _kernels_usable()
    amax = getattr(C, f"joined_amax_{fn}")
    parts = [torch.randn(n, 64, device=DEV).to(torch.bfloat16) for n in (300, 17, 129)]  # 19200, 1088, 8256
    for i, (r, c) in enumerate([(250, 3), (5, 60), (128, 63)]):  # the max in the last (partial) block of each
        parts[i][r, c] = 40.0 + i
        want = torch.cat(parts).float().abs().max()
        assert torch.equal(amax(parts).float().cpu(), want.reshape(1).cpu()), i
    parts[0][1, 1] = float("nan")  # in the first block, below the maximum's
    assert torch.isnan(amax(parts)).all()
    assert torch.isnan(amax([torch.full((4, 64), -float("inf"), device=DEV), parts[0]])).all()


def test_quantize_transpose_into_refuses_outputs_of_another_shape():
    parts = [torch.randn(16, 32), torch.randn(16, 32)]
    with pytest.raises(ValueError, match="do not hold parts joined to"):
        C.quantize_transpose_into(parts, torch.empty(16, 32).to(E4), None, torch.zeros(1))
    with pytest.raises(ValueError, match="scale must be float32"):
        C.quantize_transpose_into(parts, torch.empty(32, 32).to(E4), None, torch.zeros(1, dtype=torch.float64))
