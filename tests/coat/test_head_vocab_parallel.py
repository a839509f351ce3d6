"""The FP8 head over a vocabulary split across a TP group (megacoat.coat.head.vocab_parallel_stats, fp8_head_loss with
a group), on two CPU ranks (gloo): each rank holds half of the vocabulary's rows with its own E4M3 weight scale.

Reference: float32 autograd through the whole rows of the logits the ranks' FP8 GEMMs compute (x and each rank's
weight slice as their E4M3 codes times their scales, gathered). The loss is the cross-entropy of those logits in
bf16 (the GEMMs' output dtype) up to the log-sum-exp's rounding (1e-5 relative), on every rank the same bits; dx
(the ranks' partial sums added, as the TP region does) and the weight slices' gradients are its gradients within
E5M2's rounding of the gradient and the E4M3 operands of the backward GEMMs, 2^-3 + 2^-4 norm-wise (test_head.py's
bound for one rank)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacoat.coat.head import fp8_head_loss
from megacoat.coat.linear import Fp8Linear, quantize_x
from megacoat.model.gpt import IGNORE_INDEX
from megacoat.ops.cross_entropy_fp8 import cross_entropy_grad_fp8_ref
from tests.ops.fp8_compare import rel_err
from tests.parallel.dist_helpers import run_ranks

T, H, V = 64, 128, 512


def _batch():
    torch.manual_seed(0)
    full = torch.nn.Linear(H, V, bias=False).bfloat16()
    x = torch.randn(T, H, dtype=torch.bfloat16)
    labels = torch.randint(0, V, (T,))
    labels[[3, 40]] = IGNORE_INDEX
    labels[5] = V // 2 - 1  # the last row of rank 0's slice
    labels[6] = V // 2  # the first of rank 1's
    return full, x, labels


def _rank_head_loss():
    rank, world = dist.get_rank(), dist.get_world_size()
    full, x, labels = _batch()
    rows = V // world
    shard = Fp8Linear(torch.nn.Linear(H, rows, bias=False).bfloat16())
    with torch.no_grad():
        shard.weight.copy_(full.weight[rank * rows:(rank + 1) * rows])
    x.requires_grad_()
    loss = fp8_head_loss(shard, x, labels, IGNORE_INDEX, group=dist.group.WORLD)
    loss.backward()
    dx = x.grad.float()
    dist.all_reduce(dx)  # the partial sums over the slices: the TP region's backward
    # the reference: whole rows of the dequantized FP8 logits, in float32
    x8, _, xs = quantize_x(x.detach(), transpose=False)
    w8, _, ws = shard.fp8_cache.get((shard.weight,))
    slices = [torch.empty(rows, H) for _ in range(world)]
    dist.all_gather(slices, (w8.float() * ws).contiguous())
    xd = (x8.float() * xs).requires_grad_()
    wd = torch.cat(slices).requires_grad_()
    logits = xd @ wd.t()
    F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX).backward()
    want = F.cross_entropy(logits.detach().bfloat16().float(), labels, ignore_index=IGNORE_INDEX)  # the GEMM's bf16
    out = (loss, want, dx, xd.grad, shard.weight.grad.float(), wd.grad[rank * rows:(rank + 1) * rows])
    return [t.detach().float().numpy() for t in out]  # by value: a tensor would be shared with a process that ends


@pytest.mark.slow
def test_vocab_parallel_fp8_head_is_the_whole_rows_fp8_head():
    ranks = [[torch.from_numpy(a) for a in rank] for rank in run_ranks(2, _rank_head_loss)]
    (loss0, *_), (loss1, *_) = ranks
    assert torch.equal(loss0, loss1)  # every rank the same loss, hence the same gradient scale
    for loss, want, dx, want_dx, dw, want_dw in ranks:
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
        assert rel_err(dx, want_dx) <= 2 ** -3 + 2 ** -4
        assert rel_err(dw, want_dw) <= 2 ** -3 + 2 ** -4
        assert dx[[3, 40]].eq(0).all()  # ignored tokens: no gradient


def test_a_label_in_another_slice_counts_without_a_label_entry():
    """The gradient op with a label outside these logits' columns (another rank's slice): that row is coef * p,
    its residual 0; rows with their label here are as before."""
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    labels = torch.tensor([1, 32, IGNORE_INDEX, 7])  # 32: not among the 32 columns
    lse = torch.logsumexp(logits, 1)
    coef = torch.tensor([0.25])
    g8, _, scale, residual = cross_entropy_grad_fp8_ref(logits, labels, lse, torch.ones(1), coef, torch.float8_e5m2,
                                                        IGNORE_INDEX)
    g = g8.float() * scale
    p = torch.softmax(logits, 1) * coef
    torch.testing.assert_close(g[1], p[1], rtol=2 ** -2, atol=scale.item())  # E5M2's step
    assert g[2].eq(0).all() and residual[[1, 2]].eq(0).all() and residual[[0, 3]].ne(0).all()
    assert g[0, 1] < 0 and g[3, 7] < 0  # the label entries p_y - 1


@pytest.mark.gpu
def test_gpu_kernel_takes_another_slices_label_as_the_reference_does():
    """CUDA: the gradient kernel on a vocabulary slice whose labels are partly another slice's (V: no column here),
    against the reference: the same scale, codes within one E5M2 step (tests/ops' assert_fp8_close), the label
    entries (code plus residual) within float32 rounding, and a zero residual off the slice."""
    from megacoat.ops.cross_entropy_fp8 import cross_entropy_grad_fp8
    from tests.ops.fp8_compare import assert_fp8_close

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(256, 1024, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, 1024, (256,), device="cuda", generator=g)
    labels[::3] = 1024
    labels[1] = IGNORE_INDEX
    lse = torch.logsumexp(logits.float(), 1)
    amax, coef = torch.ones(1, device="cuda"), torch.tensor([1 / 255], device="cuda")
    g8, g8t, scale, res = cross_entropy_grad_fp8(logits, labels, lse, amax, coef, torch.float8_e5m2, IGNORE_INDEX)
    r8, _, rscale, rres = cross_entropy_grad_fp8_ref(logits, labels, lse, amax, coef, torch.float8_e5m2, IGNORE_INDEX)
    assert torch.equal(scale, rscale)
    assert_fp8_close(g8, r8)
    assert res[::3].eq(0).all() and res[1] == 0
    here = (labels >= 0) & (labels < 1024)
    y = torch.where(here, labels, 0)[:, None]
    entry, rentry = (q.float().gather(1, y)[:, 0] * scale + r for q, r in ((g8, res), (r8, rres)))
    torch.testing.assert_close(entry[here], rentry[here], rtol=1e-5, atol=1e-12)  # the label entry, code + residual
