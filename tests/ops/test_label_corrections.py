"""The FP8 head's label corrections (megacoat.ops.label_corrections): the kernel against the reference, the reference
against float64, ignored tokens, one gradient alone, pieces, torch.compile, and on the GPU the 1.3 B shape, the
transient the memory estimator counts, and the deterministic mode's path."""
import pytest
import torch

from tests.ops.fp8_compare import DEV, interpreted, rel_err  # noqa: I001
from megacoat.ops import label_corrections as L

T, H, V = 70, 160, 50


def _skip_unless_kernels_run():
    if DEV == "cpu" and not interpreted(L._label_corrections_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")


def _case(t=T, h=H, v=V, labels=7, seed=0):
    """Few distinct labels (dW's rows sum many tokens, within a tile too), ignored tokens' residual 0, and x's FP8
    codes over E4M3's range (clamped first: past 448 the cast gives NaN)."""
    g = torch.Generator().manual_seed(seed)
    dx = torch.randn(t, h, generator=g).bfloat16()
    dw = torch.randn(v, h, generator=g).bfloat16()
    weight = torch.randn(v, h, generator=g).bfloat16()
    residual = torch.randn(t, generator=g) * 1e-1
    residual[[3, 9]] = 0
    label = torch.randint(0, labels, (t,), generator=g)
    x8t = (torch.randn(h, t, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return [a.to(DEV) for a in (dx, dw, residual, label, weight, x8t, torch.tensor([0.01]))]


def _float64(dx, dw, residual, label, weight, x8t, x_scale):
    x = x8t.double().t() * x_scale.double()
    r = residual.double()[:, None]
    return dx.double() + r * weight.double()[label], dw.double().index_add(0, label, r * x)


def _assert_dx_close(a, b, residual, label, weight):
    """Two roundings of the same dx_t + r_t W[y_t] into bf16: the kernel's fused multiply-add skips the product's
    float32 rounding (2^-24 |r w|), and each result is within a bf16 step of the float32 sum (2^-7 relative; the
    interpreter's cast truncates, which is also within a step). Where the sum nearly cancels, the product's rounding
    is many steps of the small result, hence its own term."""
    product = (residual[:, None] * weight.float()[label]).abs()
    bound = 2 ** -7 * torch.maximum(a.float().abs(), b.float().abs()) + 2 ** -22 * product
    assert ((a.float() - b.float()).abs() <= bound).all()


def test_reference_is_the_float64_sum_rounded_once():
    """dx_t + r_t W[y_t] and dW + the sum of r_t x_t over each label's tokens, in float32 and rounded to bf16 once:
    within half a bf16 step (2^-9 relative) of float64, plus float32's own rounding of the sums (2^-24 per term of
    the ~T/7 rows a label sums, far below that step) -- so 2^-8 elementwise bounds both."""
    dx, dw, residual, label, weight, x8t, xs = _case()
    want_dx, want_dw = _float64(dx, dw, residual, label, weight, x8t, xs)
    L.label_corrections_ref(dx, dw, residual, label, weight, x8t, xs)
    assert ((dx.double() - want_dx).abs() <= want_dx.abs() * 2 ** -8 + 1e-30).all()
    assert ((dw.double() - want_dw).abs() <= want_dw.abs() * 2 ** -8 + 1e-6).all()


@pytest.mark.parametrize("tile", [(16, 64, 4), (32, 128, 4)])
def test_kernel_matches_reference(tile):
    """Same float32 sums, rounded once into bf16: on CUDA the kernel's fused multiply-add and its atomics' order move
    a few elements (see _assert_dx_close); under the interpreter its bf16 cast truncates, so about half move. dW's
    float32 sums only change order: within 2^-8 norm-wise, and ignored tokens (residual 0) add nothing."""
    _skip_unless_kernels_run()
    case = _case()
    ref, ker = [a.clone() for a in case[:2]], [a.clone() for a in case[:2]]
    L.label_corrections_ref(*ref, *case[2:])
    L.label_corrections_triton(*ker, *case[2:], tile=tile)
    _assert_dx_close(ker[0], ref[0], case[2], case[3], case[4])
    assert torch.equal(ker[0][[3, 9]], case[0][[3, 9]])  # ignored tokens: dx untouched
    if DEV == "cuda":
        assert (ker[0] != ref[0]).float().mean() <= 1e-3
    assert rel_err(ker[1], ref[1]) <= 2 ** -8 and not torch.equal(ker[1], case[1])


@pytest.mark.parametrize("which", ["dx", "dw"])
def test_one_gradient_alone_is_the_same_as_with_both(which):
    _skip_unless_kernels_run()
    case = _case()
    both = [a.clone() for a in case[:2]]
    L.label_corrections_triton(*both, *case[2:])
    alone = [a.clone() if n == which else None for n, a in zip(("dx", "dw"), case[:2])]
    L.label_corrections_triton(*alone, *case[2:])
    i = 0 if which == "dx" else 1
    assert torch.equal(alone[i], both[i])
    L.label_corrections_triton(None, None, *case[2:])  # nothing asked: nothing done


def test_reference_in_pieces_is_the_reference_in_one(monkeypatch):
    """The reference goes over the tokens in pieces (a bounded transient): dx row by row, so bit for bit; dW's
    float32 sums only change order, then round to bf16 once: within 2^-8 norm-wise."""
    case = _case()
    one = [a.clone() for a in case[:2]]
    L.label_corrections_ref(*one, *case[2:])
    monkeypatch.setattr(L, "LABEL_PIECE_ELEMENTS", 5 * H)  # 5 tokens a piece: 14 pieces
    many = [a.clone() for a in case[:2]]
    L.label_corrections_ref(*many, *case[2:])
    assert torch.equal(many[0], one[0]) and rel_err(many[1], one[1]) <= 2 ** -8


def test_shapes_that_do_not_match_are_refused():
    dx, dw, residual, label, weight, x8t, xs = _case()
    with pytest.raises(ValueError, match="x8t"):
        L.label_corrections(dx, dw, residual, label, weight, x8t[:, :-1], xs)
    with pytest.raises(ValueError, match="dw"):
        L.label_corrections(dx, dw[:-1], residual, label, weight, x8t, xs)
    with pytest.raises(ValueError, match="dx"):
        L.label_corrections(dx[:, :-1], dw, residual, label, weight, x8t, xs)
    with pytest.raises(ValueError, match="contiguous"):
        L.label_corrections(dx.t().contiguous().t(), dw, residual, label, weight, x8t, xs)


def test_compiled_caller_traces_the_operator():
    """Under torch.compile the corrections are the registered operator megacoat::label_corrections, which mutates
    dx and dw: a compiled caller gets the eager result."""
    case = _case()

    def corrected(dx, dw, *rest):
        dx, dw = dx.clone(), dw.clone()
        L.label_corrections(dx, dw, *rest)
        return dx, dw

    torch._dynamo.reset()
    eager = corrected(*case)
    compiled = torch.compile(corrected, fullgraph=True)(*case)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.gpu
def test_gpu_kernel_at_the_heads_shape_and_its_transient():
    """The 1.3 B head at one micro-batch of 16 sequences (32,768 tokens, 2,048 wide, 32,000 labels drawn as text
    draws them: a few frequent) against the reference; and what the memory estimator counts for it
    (megacoat.training.memory): the float32 copy of dW, 4 V K bytes, nothing per token."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    t, h, v = 32768, 2048, 32000
    case = _case(t, h, v, labels=v)
    case[3] = torch.where(torch.rand(t, device=DEV) < 0.3, case[3] % 5, case[3])  # 30% of tokens on 5 labels
    ref, ker = [a.clone() for a in case[:2]], [a.clone() for a in case[:2]]
    L.label_corrections_ref(*ref, *case[2:])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    L.label_corrections(*ker, *case[2:])
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - before
    _assert_dx_close(ker[0], ref[0], case[2], case[3], case[4])
    assert (ker[0] != ref[0]).float().mean() <= 1e-3
    assert rel_err(ker[1], ref[1]) <= 2 ** -8
    assert 4 * v * h <= transient <= 4 * v * h + (2 << 20), transient


@pytest.mark.gpu
def test_gpu_deterministic_mode_takes_the_reference():
    """torch's deterministic mode: the reference's index_add_, the same bits on every call."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    case = _case(4096, 256, 300)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            out = [a.clone() for a in case[:2]]
            L.label_corrections(*out, *case[2:])
            runs.append(out)
    finally:
        torch.use_deterministic_algorithms(False)
    ref = [a.clone() for a in case[:2]]
    L.label_corrections_ref(*ref, *case[2:])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert torch.equal(runs[0][0], ref[0])
