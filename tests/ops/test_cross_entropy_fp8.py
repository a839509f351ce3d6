"""The FP8 head's cross-entropy: the stats kernel and the gradient cast against their references, the references
against float64 autograd through F.cross_entropy, and the amax the forward predicts against the gradient's own."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.fp8_compare import DEV, assert_fp8_close, interpreted, rel_err  # noqa: I001
from megacoat.ops import cross_entropy_fp8 as C
from megacoat.ops.cast_transpose import quantize_transpose_ref

IGNORE = -100


def _skip_unless_kernels_run():
    if DEV == "cpu" and not interpreted(C._stats_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")


def _case(t, v, dtype=torch.float32, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(t, v, generator=g)).to(dtype).to(DEV)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[list(ignored)] = IGNORE
    return logits, labels.to(DEV)


def _autograd_grad(logits, labels, upstream):
    """float64 autograd of upstream * mean cross-entropy: the gradient the FP8 codes stand for."""
    z = logits.double().requires_grad_()
    (upstream * F.cross_entropy(z, labels, ignore_index=IGNORE)).backward()
    return z.grad


@pytest.mark.parametrize("t,v,ignored", [(8, 40, ()), (20, 300, (3, 7)), (16, 4096 + 24, (0,))])
def test_reference_stats_and_gradient_agree_with_autograd(t, v, ignored):
    """The reference's mean loss is F.cross_entropy's; its amax is max|p - onehot| over counted tokens; its codes
    dequantize to float64 autograd's gradient within half an E5M2 step (2^-3 relative) plus the smallest step."""
    logits, labels = _case(t, v, ignored=ignored)
    loss_rows, lse, amax = C.cross_entropy_stats_ref(logits, labels, IGNORE)
    count = (labels != IGNORE).sum()
    torch.testing.assert_close(loss_rows.sum() / count, F.cross_entropy(logits, labels, ignore_index=IGNORE))
    assert loss_rows[list(ignored)].eq(0).all()
    want = _autograd_grad(logits, labels, 1.0) * count  # the summed loss's gradient
    torch.testing.assert_close(amax, want.abs().amax().float().reshape(1), rtol=1e-6, atol=0)
    coef = torch.tensor([0.5], device=DEV) / count
    g8, g8t, scale, residual = C.cross_entropy_grad_fp8_ref(logits, labels, lse, amax, coef, torch.float8_e5m2,
                                                            IGNORE)
    exact = _autograd_grad(logits, labels, 0.5)
    err = (g8.double() * scale.double() - exact).abs()
    assert (err <= exact.abs() * 2 ** -3 + scale.double() * 2 ** -16).all()
    assert g8[list(ignored)].float().eq(0).all()
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
    # the label entry's code plus its residual is the float32 gradient's entry: exact up to exp's float32 rounding
    counted = labels != IGNORE
    y = labels.clamp(min=0)[:, None]
    label_entry = g8.double().gather(1, y)[:, 0] * scale.double() + residual.double()
    torch.testing.assert_close(label_entry[counted], exact.gather(1, y)[:, 0][counted], rtol=1e-5, atol=1e-12)
    assert residual[~counted].eq(0).all() and residual.dtype == torch.float32


def test_reference_codes_are_current_scaling_of_the_float32_gradient():
    """Given the float32 gradient itself, quantize_transpose (current scaling) writes the same codes and scale."""
    logits, labels = _case(24, 200, ignored=(5,))
    _, lse, amax = C.cross_entropy_stats_ref(logits, labels, IGNORE)
    coef = torch.tensor([1.0], device=DEV) / 23
    g8, g8t, scale, _ = C.cross_entropy_grad_fp8_ref(logits, labels, lse, amax, coef, torch.float8_e5m2, IGNORE)
    p = torch.exp(logits - lse[:, None])
    g = (p - F.one_hot(labels.clamp(min=0), 200)) * coef
    g[5] = 0
    r8, r8t, rscale = quantize_transpose_ref(g, torch.float8_e5m2)
    torch.testing.assert_close(scale, rscale, rtol=2 ** -23, atol=0)  # amax: the same max, up to one rounding
    assert_fp8_close(g8, r8)


@pytest.mark.parametrize("t,v,ignored", [(8, 40, ()), (70, 300, (3, 7, 69)), (16, 4096 + 24, (0,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(t, v, ignored, dtype):
    """The kernels' log-sum-exp, loss and amax are the reference's float32 values up to exp's and log's rounding;
    the codes agree as cast_transpose's do (fp8_compare), and both layouts are one tile's bytes. The label entry
    each returns, code plus residual, is the float32 gradient's entry in both (whatever code each rounded to)."""
    _skip_unless_kernels_run()
    logits, labels = _case(t, v, dtype, ignored)
    loss_k, lse_k, amax_k = C.cross_entropy_stats_triton(logits, labels, IGNORE)
    loss_r, lse_r, amax_r = C.cross_entropy_stats_ref(logits, labels, IGNORE)
    torch.testing.assert_close(lse_k, lse_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_k, loss_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(amax_k, amax_r, rtol=1e-5, atol=0)
    coef = torch.tensor([0.25], device=DEV) / (t - len(ignored))
    for grad_dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        g8, g8t, scale, res = C.cross_entropy_grad_fp8_triton(logits, labels, lse_r, amax_r, coef, grad_dtype,
                                                              IGNORE)
        r8, r8t, rscale, rres = C.cross_entropy_grad_fp8_ref(logits, labels, lse_r, amax_r, coef, grad_dtype, IGNORE)
        assert torch.equal(scale, rscale)  # the same float32 product and division
        y = labels.clamp(min=0)[:, None]
        entry, rentry = (q.float().gather(1, y)[:, 0] * scale + r for q, r in ((g8, res), (r8, rres)))
        torch.testing.assert_close(entry, rentry, rtol=1e-5, atol=1e-12)
        assert res[list(ignored)].eq(0).all()
        if DEV == "cuda":
            assert_fp8_close(g8, r8)
        else:  # the interpreter's casts (fp8_compare) and exp's rounding
            assert rel_err(g8.float(), r8.float()) <= 0.15
        assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
        only_t = C.cross_entropy_grad_fp8_triton(logits, labels, lse_r, amax_r, coef, grad_dtype, IGNORE,
                                                 rowwise=False)
        assert only_t[0] is None and torch.equal(only_t[1].view(torch.uint8), g8t.view(torch.uint8))
        assert torch.equal(only_t[3], res)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_small_label_probabilities_round_to_zero_and_the_residual_keeps_them(path):
    """Why the residual exists: one token with p_y ~ 0 sets the amax to ~c, and every other label entry c (p_y - 1)
    with p_y < 1/14 then lies above the midpoint 13/14 of E5M2's top two codes (c and 6/7 c): its code says p_y = 0,
    an error of c p_y, of one sign for all of them. The code plus the residual is c (p_y - 1) again."""
    if path == "triton":
        _skip_unless_kernels_run()
    t, v = 32, 64
    labels = torch.arange(t, device=DEV) % v
    logits = torch.zeros(t, v, device=DEV)
    logits[torch.arange(t), labels] = torch.linspace(0.5, 2.0, t, device=DEV)  # p_y from ~0.026 to ~0.11
    logits[0, labels[0]] = -30.0  # p_y ~ 0: the amax
    p_y = torch.softmax(logits, 1)[torch.arange(t), labels]
    small = (p_y < 1 / 14 - 1e-3) & (p_y > 0.02)  # token 0 aside
    assert small.sum() >= 8 and small[1:].sum() == small.sum()
    stats = C.cross_entropy_stats_triton if path == "triton" else C.cross_entropy_stats_ref
    grad = C.cross_entropy_grad_fp8_triton if path == "triton" else C.cross_entropy_grad_fp8_ref
    _, lse, amax = stats(logits, labels, IGNORE)
    coef = torch.tensor([1.0 / t], device=DEV)
    g8, _, scale, residual = grad(logits, labels, lse, amax, coef, torch.float8_e5m2, IGNORE)
    code_y = g8.float()[torch.arange(t), labels] * scale
    assert torch.equal(code_y[small], torch.full_like(code_y[small], -1.0 / t))  # p_y read as 0
    torch.testing.assert_close(code_y + residual, (p_y - 1) / t, rtol=1e-5, atol=0)
    assert (residual[small] > 0).all()  # one sign: the code overstates |g_y| by c p_y


def test_bad_labels_and_logits_are_visible():
    """A label outside [0, V) makes the kernel's loss and amax NaN (the reference raises: checked on the CPU, where
    torch's gather raises instead of a CUDA device-side assert that would end the process's CUDA context); a NaN
    logit makes its token's loss and the amax NaN."""
    _skip_unless_kernels_run()
    logits, labels = _case(8, 40)
    labels[2] = 40
    loss, _, amax = C.cross_entropy_stats_triton(logits, labels, IGNORE)
    assert loss[2].isnan() and amax.isnan().all() and loss[[0, 1, 3]].isfinite().all()
    with pytest.raises(RuntimeError):
        C.cross_entropy_stats_ref(logits.cpu(), labels.cpu(), IGNORE)
    logits, labels = _case(8, 40)
    logits[5, 9] = float("nan")
    loss, _, amax = C.cross_entropy_stats_triton(logits, labels, IGNORE)
    assert loss[5].isnan() and amax.isnan().all()
    with pytest.raises(ValueError, match="int64 labels"):
        C.cross_entropy_stats(logits, labels.int(), IGNORE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_vocabulary_shape_matches_reference(dtype):
    """The 1.3 B model's head at 2048 tokens (a 32 k vocabulary), on CUDA: the stats and the codes against the
    references, both layouts one tile's bytes (float32 logits: the byte-transpose path around Triton's bug), every
    code under torch.compile's operator too."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    logits, labels = _case(2048, 32000, dtype, ignored=(0, 1000))
    loss_k, lse_k, amax_k = C.cross_entropy_stats(logits, labels, IGNORE)
    loss_r, lse_r, amax_r = C.cross_entropy_stats_ref(logits, labels, IGNORE)
    torch.testing.assert_close(lse_k, lse_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_k, loss_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(amax_k, amax_r, rtol=1e-5, atol=0)
    coef = torch.tensor([1.0], device=DEV) / 2046
    g8, g8t, scale, res = C.cross_entropy_grad_fp8(logits, labels, lse_r, amax_r, coef, torch.float8_e5m2, IGNORE)
    r8, _, rscale, rres = C.cross_entropy_grad_fp8_ref(logits, labels, lse_r, amax_r, coef, torch.float8_e5m2,
                                                       IGNORE)
    assert torch.equal(scale, rscale)
    assert_fp8_close(g8, r8)
    assert torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))
    y = labels.clamp(min=0)[:, None]
    entry, rentry = (q.float().gather(1, y)[:, 0] * scale + r for q, r in ((g8, res), (r8, rres)))
    torch.testing.assert_close(entry, rentry, rtol=1e-5, atol=1e-12)
    compiled = torch.compile(C.cross_entropy_grad_fp8, fullgraph=True)
    c8, c8t, cscale, cres = compiled(logits, labels, lse_r, amax_r, coef, torch.float8_e5m2, IGNORE)
    assert torch.equal(cscale, scale) and torch.equal(c8.view(torch.uint8), g8.view(torch.uint8)) \
        and torch.equal(c8t.view(torch.uint8), g8t.view(torch.uint8)) and torch.equal(cres, res)


def _kernels_against_reference_by_rows(logits, labels, chunk):
    """The kernels on the whole [T, V] against the reference on `chunk` rows at a time (the reference's float32
    temporaries of a whole 128 k-vocabulary batch would be ~9 GB each): stats, both layouts' codes, the label
    entries."""
    t = logits.shape[0]
    loss_k, lse_k, amax_k = C.cross_entropy_stats_triton(logits, labels, IGNORE)
    coef = torch.tensor([1.0], device=logits.device) / (labels != IGNORE).sum()
    g8, g8t, scale, res = C.cross_entropy_grad_fp8_triton(logits, labels, lse_k, amax_k, coef, torch.float8_e5m2,
                                                          IGNORE)
    amax_r = torch.zeros_like(amax_k)
    for lo in range(0, t, chunk):
        rows = slice(lo, min(lo + chunk, t))
        loss_r, lse_r, row_amax = C.cross_entropy_stats_ref(logits[rows], labels[rows], IGNORE)
        torch.testing.assert_close(lse_k[rows], lse_r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss_k[rows], loss_r, rtol=1e-5, atol=1e-5)
        amax_r = torch.maximum(amax_r, row_amax)
        r8, _, rscale, rres = C.cross_entropy_grad_fp8_ref(logits[rows], labels[rows], lse_k[rows], amax_k, coef,
                                                           torch.float8_e5m2, IGNORE, transpose=False)
        assert torch.equal(scale, rscale)
        assert_fp8_close(g8[rows], r8)
        assert torch.equal(g8t[:, rows].view(torch.uint8), g8[rows].t().view(torch.uint8))
        y = labels[rows].clamp(min=0)[:, None]
        entry, rentry = (q.float().gather(1, y)[:, 0] * scale + r for q, r in ((g8[rows], res[rows]), (r8, rres)))
        torch.testing.assert_close(entry, rentry, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(amax_k, amax_r, rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_gpu_logits_past_2_31_elements():
    """Llama 3's 128 k vocabulary at 16,768 tokens: T x V passes 2^31 (micro-batch 8 at sequence 2,048 stays just
    below it; 16 is twice past), so a 32-bit offset would wrap in both layouts (rows x V in g8, columns x T in
    g8^T). Every row against the reference, an ignored token past the wrap included."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    t, v = 16768, 128256
    assert t * v > 2 ** 31 and (t - 3) * v > 2 ** 31
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = 3 * torch.randn(t, v, device=DEV, dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, v, (t,), device=DEV, generator=g)
    labels[[5, t - 3]] = IGNORE
    _kernels_against_reference_by_rows(logits, labels, chunk=2048)
