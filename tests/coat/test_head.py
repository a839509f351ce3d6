"""The FP8 output layer fused with its cross-entropy (megacoat.coat.head): its loss is the FP8 head's logits'
cross-entropy, its gradients those of that forward within E5M2's rounding with each label entry's rounding added
back, ignored tokens count nowhere, it keeps what it says it keeps, syncs nothing, and the converted GPT takes it
when it has labels."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.coat.flow_paths import triton_paths  # noqa: I001
from tests.coat.test_no_host_sync import SyncRecorder
from tests.ops.fp8_compare import DEV, interpreted, rel_err
from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.head import Fp8Head, fp8_head_loss
from megacoat.coat.linear import Fp8Linear, quantize_x
from tests.coat.saved_memory import saved_activation_bytes
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, IGNORE_INDEX, Head
from megacoat.ops.cross_entropy_fp8 import _stats_kernel

T, H, V = 64, 128, 512


def _paths(path):
    if path == "triton" and DEV == "cpu" and not interpreted(_stats_kernel):
        pytest.skip("kernels were imported before TRITON_INTERPRET was set")
    return triton_paths() if path == "triton" and DEV == "cpu" else contextlib.nullcontext()


def _head_and_batch(seed=0):
    torch.manual_seed(seed)
    head = Fp8Linear(torch.nn.Linear(H, V, bias=False, device=DEV).bfloat16())
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (T,), device=DEV)
    labels[[3, 40]] = IGNORE_INDEX
    return head, x, labels


def _dequantized_forward_grads(head, x, labels):
    """float32 autograd through the logits the FP8 GEMM computes (x and W as their E4M3 codes times their scales):
    the gradient the fused backward's FP8 codes and GEMMs approximate."""
    x8, _, xs = quantize_x(x, transpose=False)
    w8, _, ws = head.fp8_cache.get((head.weight,))
    xd = (x8.float() * xs).requires_grad_()
    wd = (w8.float() * ws).requires_grad_()
    F.cross_entropy(xd @ wd.t(), labels, ignore_index=IGNORE_INDEX).backward()
    return xd.grad, wd.grad


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_loss_is_the_fp8_heads_and_gradients_are_within_e5m2(path):
    """The loss: F.cross_entropy of the unfused FP8 head's very logits (the same GEMM on the same codes), up to
    the kernel's log-sum-exp rounding. The gradients: the exact gradient of that forward within 2^-3 relative
    (norm-wise), the bound of E5M2's rounding of each gradient element (2 mantissa bits: half a step is at most 2^-3
    of the value), which the GEMMs' sums only average down; the E4M3 operands of the backward GEMMs add their own
    rounding (2^-4), so 2^-3 + 2^-4 in all."""
    head, x, labels = _head_and_batch()
    with _paths(path):  # the same casts of x for all three
        loss = fp8_head_loss(head, x, labels, IGNORE_INDEX)
        loss.backward()
        want = F.cross_entropy(head(x.detach()).float(), labels, ignore_index=IGNORE_INDEX)
        dx, dw = _dequantized_forward_grads(head, x.detach(), labels)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    assert rel_err(x.grad, dx) <= 2 ** -3 + 2 ** -4
    assert rel_err(head.weight.grad, dw) <= 2 ** -3 + 2 ** -4
    assert x.grad[[3, 40]].eq(0).all()  # ignored tokens: no gradient


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_label_entries_are_added_back_through_the_bf16_weight_and_the_fp8_input(path):
    """dx and dW are the FP8 GEMMs of the gradient's codes plus each label entry's residual r: dx_t += r_t W[y_t]
    with the BF16 weight, dW[y] += the sum of r_t x_t over the tokens labelled y (x as wgrad's E4M3 copy), repeated
    labels summed. Emulated in float64 from the codes and residuals of the same ops (head_loss's names, which the
    kernels' path swaps); the library rounds dx and dW to bf16 twice (the GEMM's output, then the sum), so 2^-8
    relative; under the CPU interpreter the corrections kernel's bf16 cast truncates (up to a whole step, 2^-7)."""
    from megacoat.coat import head as head_loss
    head, x, labels = _head_and_batch()
    labels[labels != IGNORE_INDEX] %= 7  # few distinct labels: dW's scatter sums many tokens into one row
    with _paths(path):
        fp8_head_loss(head, x, labels, IGNORE_INDEX).backward()
        x8, x8t, xs = head_loss.quantize_x(x.detach(), transpose=True)
        w8, _, ws = head.fp8_cache.get((head.weight,))
        logits = torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        _, lse, amax = head_loss.cross_entropy_stats(logits, labels, IGNORE_INDEX)
        count = (labels != IGNORE_INDEX).sum()
        g8, _, gs, r = head_loss.cross_entropy_grad_fp8(logits, labels, lse, amax, torch.ones(1, device=DEV) / count,
                                                        torch.float8_e5m2, IGNORE_INDEX)
    g, xd, wd = g8.double() * gs.double(), x8.double() * xs.double(), w8.double() * ws.double()
    y = labels.clamp(min=0)
    dx = g @ wd + r.double()[:, None] * head.weight.detach().double()[y]
    dw = g.t() @ xd + torch.zeros(V, H, dtype=torch.float64, device=DEV).index_add_(0, y, r.double()[:, None] * xd)
    assert r.abs().max() > 0 and r[[3, 40]].eq(0).all()
    bound = 2 ** -7 if path == "triton" and DEV == "cpu" else 2 ** -8
    assert rel_err(x.grad, dx) <= bound and rel_err(head.weight.grad, dw) <= bound


def test_keeps_the_logits_their_log_sum_exp_and_the_inputs_fp8_transpose():
    """Kept for backward: the bf16 logits (2 B a logit, as the compiled loss keeps them; on ctx, which backward frees
    early), and saved: their float32 log-sum-exp and the labels (a view of the batch's), x8^T (1 B an element, not x)
    with its scale, and two scalars."""
    head, x, labels = _head_and_batch()
    losses = []

    def forward():
        losses.append(fp8_head_loss(head, x, labels, IGNORE_INDEX))
        return losses[-1]

    saved, by_dtype = saved_activation_bytes(forward, head.parameters())
    assert saved == 4 * T + 8 * T + T * H + 4 + 4 + 8, by_dtype  # ... scale, amax, count
    logits = losses[0].grad_fn.logits  # the node is the function's ctx
    assert logits.dtype == torch.bfloat16 and logits.shape == (T, V)


def test_the_logits_and_their_fp8_gradient_are_freed_as_backward_goes(monkeypatch):
    """The logits are gone once their FP8 gradient is written, before the GEMMs write dx and dW, and that gradient
    (both layouts) is gone by the time the label corrections run, so their float32 copy of dW (4 V K) never sits
    beside it: the head's peak is the logits and their gradient, as a compiled BF16 loss's, and the memory estimator
    counts the larger of that and the copy, not their sum. A second backward through the same forward is refused."""
    import weakref

    import megacoat.coat.head as hl

    grads, alive = [], []

    def grad_fp8(logits, *args, **kwargs):
        out = hl_cross_entropy_grad_fp8(logits, *args, **kwargs)
        grads.extend(weakref.ref(g) for g in (logits, *out[:2]))
        return out

    def linear_grads(*args):
        alive.append([g() is not None for g in grads])
        return hl_fp8_linear_grads(*args)

    def corrections(*args):
        alive.append([g() is not None for g in grads])
        return hl_label_corrections(*args)

    hl_cross_entropy_grad_fp8, hl_label_corrections = hl.cross_entropy_grad_fp8, hl.label_corrections
    hl_fp8_linear_grads = hl.fp8_linear_grads
    monkeypatch.setattr(hl, "cross_entropy_grad_fp8", grad_fp8)
    monkeypatch.setattr(hl, "fp8_linear_grads", linear_grads)
    monkeypatch.setattr(hl, "label_corrections", corrections)
    head, x, labels = _head_and_batch()
    loss = fp8_head_loss(head, x, labels, IGNORE_INDEX)
    loss.backward(retain_graph=True)
    # at the GEMMs: the logits gone, their FP8 gradient alive; at the corrections: all three gone
    assert len(grads) == 3 and alive == [[False, True, True], [False, False, False]]
    assert x.grad is not None and head.weight.grad is not None
    with pytest.raises(RuntimeError, match="runs once per forward"):
        loss.backward()


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_no_host_sync(path):
    head, x, labels = _head_and_batch()
    fp8_head_loss(head, x, labels, IGNORE_INDEX)  # builds the weight copy (outside the check, as a step's first)
    with _paths(path), SyncRecorder() as rec:
        fp8_head_loss(head, x, labels, IGNORE_INDEX).backward()
    assert rec.syncs == []


def test_the_converted_gpt_takes_it_with_labels_and_returns_logits_without():
    cfg = ModelConfig(num_layers=1, vocab_size=V, hidden_size=H, ffn_hidden_size=256, num_attention_heads=4,
                      seq_length=32)
    torch.manual_seed(0)
    model = convert_to_coat(GPT(cfg).to(DEV).bfloat16(), recipe_of(mode="coat", group_size=32, output_layer=True))
    assert type(model.head) is Fp8Head
    tokens = torch.randint(0, V, (2, 32), device=DEV)
    labels = torch.randint(0, V, (2, 32), device=DEV)
    logits = model(tokens)
    assert logits.shape == (2, 32, V)
    torch.testing.assert_close(model(tokens, labels), F.cross_entropy(logits.flatten(0, 1).float(),
                                                                       labels.flatten()), rtol=1e-5, atol=0)
    plain = convert_to_coat(GPT(cfg), recipe_of(mode="coat", group_size=32))
    assert type(plain.head) is Head


@pytest.mark.gpu
def test_gpu_loss_gradients_and_no_sync():
    """On the device: the loss and gradient bounds above, the label entries' correction, and CUDA's own sync check
    over a second step."""
    if DEV != "cuda":
        pytest.skip("needs CUDA")
    test_loss_is_the_fp8_heads_and_gradients_are_within_e5m2("triton")
    test_label_entries_are_added_back_through_the_bf16_weight_and_the_fp8_input("triton")
    head, x, labels = _head_and_batch()
    fp8_head_loss(head, x, labels, IGNORE_INDEX).backward()  # Triton compiles, the weight copy: outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_head_loss(head, x, labels, IGNORE_INDEX).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
