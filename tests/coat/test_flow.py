"""The COAT precision-flow functions against fp32 autograd of the same math, and what they save."""
import pytest
import torch
import torch.nn.functional as F

from tests.ops.fp8_compare import DEV, rel_err  # noqa: I001
from megacoat.ops.formats import E4M3, E5M2
from megacoat.coat.linear import Fp8WeightCache, fp8_linear
from megacoat.coat.flow import FlowSettings, coat_mlp, coat_norm_qkv
from tests.coat.saved_memory import saved_activation_bytes
from megacoat.model.gpt import apply_rope, rope_tables

U4, U5 = E4M3.unit_roundoff, E5M2.unit_roundoff


def _rmsnorm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _params(h, f, dtype):
    mk = lambda *s: torch.nn.Parameter((torch.randn(*s, device=DEV) * 0.05).to(dtype))  # noqa: E731
    return torch.nn.Parameter((1 + 0.1 * torch.randn(h, device=DEV)).to(dtype)), mk(f, h), mk(f, h), mk(h, f)


def _caches():
    return Fp8WeightCache(), Fp8WeightCache()


def _fp32_copies(ps):
    return [p.detach().float().requires_grad_() for p in ps]


@pytest.mark.parametrize("h,f,g", [(128, 352, 64), (192, 512, 128)])
def test_mlp_against_fp32(h, f, g):
    dtype = torch.bfloat16
    nw, w1, w3, w2 = _params(h, f, dtype)
    x = torch.randn(64, h, device=DEV, dtype=dtype, requires_grad=True)
    out = coat_mlp(x, nw, (w1, w3, w2), _caches(), FlowSettings(1e-5, g))
    dy = torch.randn_like(out)
    out.backward(dy)
    xf, nwf, w1f, w3f, w2f = _fp32_copies([x, nw, w1, w3, w2])
    n = _rmsnorm(xf, nwf)
    outf = (F.silu(n @ w1f.t()) * (n @ w3f.t())) @ w2f.t()
    outf.backward(dy.float())
    # forward: E4M3 casts of x (group), norm output, w1|w3, a1 and a3 (group), s, w2: error compounds to a few U
    assert rel_err(out, outf) <= 4 * U4
    # backward adds the E5M2 casts of the output gradient and of da1|da3
    for got, want in ((x.grad, xf.grad), (w1.grad, w1f.grad), (w3.grad, w3f.grad), (w2.grad, w2f.grad),
                      (nw.grad, nwf.grad)):
        assert F.cosine_similarity(got.float().flatten(), want.flatten(), dim=0) >= 0.98
        assert rel_err(got, want) <= 4 * U4 + 2 * U5


def test_norm_qkv_against_fp32():
    """RMSNorm → [q|k|v] GEMM → RoPE of q and k, grouped-query shapes (4 query heads, 2 key/value heads of 32)."""
    b, s, h, d = 2, 16, 128, 32
    nw, wq, _, _ = _params(h, 4 * d, torch.bfloat16)
    _, wk, wv, _ = _params(h, 2 * d, torch.bfloat16)
    cos, sin = (t.to(DEV) for t in rope_tables(d, s, 10000.0))
    x = torch.randn(b, s, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = coat_norm_qkv(x, nw, (wq, wk, wv), Fp8WeightCache(), FlowSettings(1e-5, 64), cos, sin)
    assert (q.shape, k.shape, v.shape) == ((b, s, 4, d), (b, s, 2, d), (b, s, 2, d))
    dys = [torch.randn_like(t) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), dys)
    xf, nwf, wqf, wkf, wvf = _fp32_copies([x, nw, wq, wk, wv])
    n = _rmsnorm(xf, nwf)
    qf, kf, vf = ((n @ w.t()).view(b, s, -1, d) for w in (wqf, wkf, wvf))
    outs = (apply_rope(qf, cos, sin), apply_rope(kf, cos, sin), vf)
    torch.autograd.backward(outs, [dy.float() for dy in dys])
    for got, want in zip((q, k, v), outs):
        assert rel_err(got, want) <= 3 * U4  # x (group), norm output, weights; the rotation is exact in fp32
    # the output gradient is cast once (E5M2), after RoPE's backward in fp32 rounded to bf16
    for got, want in ((x.grad, xf.grad), (wq.grad, wqf.grad), (wk.grad, wkf.grad), (wv.grad, wvf.grad),
                      (nw.grad, nwf.grad)):
        assert rel_err(got, want) <= 3 * U4 + U5


def test_norm_qkv_residual_branch_gradient_joins_in_the_norm_kernel():
    """residual=True returns x for the block's residual branch; x's gradient is then the norm path's (a) plus that
    branch's (r), summed in fp32 and rounded once, where autograd's add rounds a first and then the sum. The two
    differ by at most those two roundings: u|a| + u|a + r| with u = 2^-8, BF16's unit roundoff (doubled here, as
    a bound on both results' distance from the exact sum); q, k, v and the weight gradients are the very same."""
    b, s, h, d = 2, 16, 128, 32
    nw, wq, wk, wv = (p.detach() for p in _params(h, 4 * d, torch.bfloat16))
    cos, sin = (t.to(DEV) for t in rope_tables(d, s, 10000.0))
    x0 = torch.randn(b, s, h, device=DEV, dtype=torch.bfloat16)
    dys = [torch.randn(b, s, 4, d, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    dh = torch.randn(b, s, h, device=DEV, dtype=torch.bfloat16)

    def run(residual, branch_grad):
        x, ws = x0.clone().requires_grad_(), [w.clone().requires_grad_() for w in (nw, wq, wk, wv)]
        out = coat_norm_qkv(x, ws[0], tuple(ws[1:]), Fp8WeightCache(), FlowSettings(1e-5, 64), cos, sin,
                            residual=residual)
        branch = out[3] if residual else x
        assert branch.shape == x.shape and torch.equal(branch, x)
        torch.autograd.backward((*out[:3], branch), (*dys, branch_grad))
        return out[:3], x.grad.float(), [w.grad for w in ws]

    qkv0, dx0, dw0 = run(False, dh)
    qkv1, dx1, dw1 = run(True, dh)
    norm_path = run(False, torch.zeros_like(dh))[1]  # a, as autograd rounds it
    assert all(torch.equal(p, q) for p, q in zip(qkv0, qkv1))
    assert all(torch.equal(p, q) for p, q in zip(dw0, dw1))
    assert not torch.equal(dx0, dx1)  # rounded once: some elements move
    u = 2.0 ** -8
    assert ((dx0 - dx1).abs() <= 2 * u * (norm_path.abs() + dx1.abs())).all()


def test_mlp_residual_branch_gradient_joins_in_the_norm_kernel():
    """coat_mlp(residual=True) returns (out, x): the block's residual branch reads x there, and its gradient joins
    x's in the norm's backward kernel, rounded once (as the QKV site's test above; the same bound); out and the
    weight gradients are the very same as without it."""
    h, f, g = 128, 352, 64
    ps = [p.detach() for p in _params(h, f, torch.bfloat16)]
    x0 = torch.randn(64, h, device=DEV, dtype=torch.bfloat16)
    dy, dh = (torch.randn(64, h, device=DEV, dtype=torch.bfloat16) for _ in range(2))

    def run(residual, branch_grad):
        x, ws = x0.clone().requires_grad_(), [p.clone().requires_grad_() for p in ps]
        out = coat_mlp(x, ws[0], ws[1:], _caches(), FlowSettings(1e-5, g), residual=residual)
        out, branch = out if residual else (out, x)
        assert torch.equal(branch, x)
        torch.autograd.backward((out, branch), (dy, branch_grad))
        return out, x.grad.float(), [w.grad for w in ws]

    out0, dx0, dw0 = run(False, dh)
    out1, dx1, dw1 = run(True, dh)
    mlp_path = run(False, torch.zeros_like(dh))[1]
    assert torch.equal(out0, out1) and all(torch.equal(p, q) for p, q in zip(dw0, dw1))
    assert not torch.equal(dx0, dx1)
    u = 2.0 ** -8
    assert ((dx0 - dx1).abs() <= 2 * u * (mlp_path.abs() + dx1.abs())).all()


def test_mlp_add_is_the_mlp_of_the_sum():
    """coat_mlp(x, add=a, residual=True) makes h = x + a in the norm's kernel: out and h the same bytes as
    coat_mlp(x + a, residual=True), and x and a both receive h's gradient there, byte for byte."""
    h, f, g = 128, 352, 64
    ps = [p.detach() for p in _params(h, f, torch.bfloat16)]
    x0, a0, dy, dh = (torch.randn(64, h, device=DEV, dtype=torch.bfloat16) for _ in range(4))

    def run(fused):
        x, a, ws = x0.clone().requires_grad_(), a0.clone().requires_grad_(), [p.clone().requires_grad_() for p in ps]
        args = (_caches(), FlowSettings(1e-5, g))
        out, hh = (coat_mlp(x, ws[0], ws[1:], *args, residual=True, add=a) if fused
                   else coat_mlp(x + a, ws[0], ws[1:], *args, residual=True))
        torch.autograd.backward((out, hh), (dy, dh))
        return out, hh, x.grad, a.grad, [w.grad for w in ws]

    plain, fused = run(False), run(True)
    for p, q in zip(plain[:4], fused[:4]):
        assert torch.equal(p, q)
    assert torch.equal(fused[2], fused[3])  # one gradient for both addends
    assert all(torch.equal(p, q) for p, q in zip(plain[4], fused[4]))
    with pytest.raises(ValueError, match="add needs residual=True"):
        coat_mlp(x0, ps[0], ps[1:], _caches(), FlowSettings(1e-5, g), add=a0)


def test_mlp_add_carrier_hands_the_amax_to_the_linear_that_made_add():
    """a = fp8_linear(c, W, carry_amax=True) feeding coat_mlp(x, add=a, add_carrier=carrier): the norm's backward
    kernel folds in the amax of h's gradient and the linear's backward casts its output gradient from it, one launch
    instead of two. Every output and gradient is the same bytes as without the carrier (a max in any order is the
    same max); a carrier that is not used (its gradient None) leaves the amax to the linear's own pass."""
    h, f, g = 128, 352, 64
    ps = [p.detach() for p in _params(h, f, torch.bfloat16)]
    wo0 = (torch.randn(h, h, device=DEV) * 0.05).to(torch.bfloat16)
    x0, c0, dy, dh = (torch.randn(64, h, device=DEV, dtype=torch.bfloat16) for _ in range(4))

    def run(carry):
        x, c, wo = x0.clone().requires_grad_(), c0.clone().requires_grad_(), wo0.clone().requires_grad_()
        ws = [p.clone().requires_grad_() for p in ps]
        args = (_caches(), FlowSettings(1e-5, g))
        if carry:
            a, carrier = fp8_linear(c, wo, carry_amax=True)
            out, hh = coat_mlp(x, ws[0], ws[1:], *args, residual=True, add=a, add_carrier=carrier)
        else:
            out, hh = coat_mlp(x, ws[0], ws[1:], *args, residual=True, add=fp8_linear(c, wo))
        torch.autograd.backward((out, hh), (dy, dh))
        return [out, hh, x.grad, c.grad, wo.grad] + [w.grad for w in ws]

    plain, carried = run(False), run(True)
    assert all(torch.equal(p, q) for p, q in zip(plain, carried))
    c = c0.clone().requires_grad_()
    a, carrier = fp8_linear(c, wo0, carry_amax=True)  # carrier unused: the linear takes the amax itself
    a.backward(dh)
    c_ref = c0.clone().requires_grad_()
    fp8_linear(c_ref, wo0).backward(dh)
    assert torch.equal(c.grad, c_ref.grad)
    with pytest.raises(ValueError, match="add_carrier needs add"):
        coat_mlp(x0, ps[0], ps[1:], _caches(), FlowSettings(1e-5, g), residual=True, add_carrier=carrier)


def test_mlp_saves_only_fp8_and_small_scales():
    h, f, m = 128, 352, 64
    nw, w1, w3, w2 = _params(h, f, torch.bfloat16)
    x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    total, by_dtype = saved_activation_bytes(
        lambda: coat_mlp(x, nw, (w1, w3, w2), _caches(), FlowSettings(1e-5, 64)),
        [nw, w1, w3, w2])
    assert "bfloat16" not in by_dtype
    assert by_dtype["float8_e4m3fn"] == m * h + 2 * m * f  # norm input + SwiGLU's pair, one byte each
    assert by_dtype["float32"] < 0.1 * total  # group scales (1/G of the data, 4 bytes) and rstd


@pytest.mark.gpu
def test_gpu_mlp_llama_shape():
    nw, w1, w3, w2 = _params(4096, 11008, torch.bfloat16)
    x = torch.randn(2048, 4096, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out = coat_mlp(x, nw, (w1, w3, w2), _caches(), FlowSettings(1e-5, 128))
    out.backward(torch.randn_like(out))
    with torch.no_grad():
        xf = x.float()
        n = _rmsnorm(xf, nw.float())
        outf = (F.silu(n @ w1.float().t()) * (n @ w3.float().t())) @ w2.float().t()
    assert rel_err(out, outf) <= 4 * U4
    assert torch.isfinite(x.grad).all() and torch.isfinite(w1.grad).all()
